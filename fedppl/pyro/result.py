"""``PVIResult``: what the Pyro port's ``PVI.run`` returns, the core's
:class:`fedppl.infer.variational.PVIResult` with torch tensors (``q``, the factors, the private
guides) and torch's randomness (``rng_key`` a ``torch.Generator``); its history, summary, JSON and
ArviZ export are the core's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from fedppl.infer.pvi_result import PVIResult as CoreResult
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.guides.pvi_guide import PVIGuide

__all__ = ["PVIResult"]


@dataclass(kw_only=True)
class PVIResult(CoreResult):
    """The outcome of a run (see :class:`fedppl.PVIResult`), in torch."""

    def check(self, *args: Any, **kwargs: Any):
        """Not yet for Pyro models (the clients' log-likelihoods at the draws are evaluated
        through NumPyro's tracing); write the model in NumPyro to check it."""
        raise NotImplementedError("check and refine are not available for Pyro results yet: the "
                                  "clients' log-likelihoods at the server's draws are evaluated "
                                  "with NumPyro's handlers. Fit the NumPyro version of the model "
                                  "with fedppl.PVI to check it against the pooled posterior")

    refine = check

    def sample(self, rng_key: torch.Generator, num_samples: int,  # type: ignore[override]
               client: int | str | None = None) -> dict[str, Tensor]:
        """Joint posterior draws keyed by site name, constrained: ``{name: (num_samples, ...)}``;
        ``client`` (an index or a name) adds that client's local sites."""
        local = None
        if client is not None and self.local is not None:
            local = g.index(self.local, self._client_index(client, self.factors.nat1.shape[0]))
        guide = cast(PVIGuide, self.guide)
        return guide.sample(as_generator(rng_key), self.q, num_samples, local)

    def predictive(self, rng_key: torch.Generator, *args: Any,  # type: ignore[override]
                   num_samples: int = 1000, client: int | str | None = None,
                   **kwargs: Any) -> dict[str, Tensor]:
        """Posterior predictive draws (Pyro's ``Predictive`` with this posterior's draws)."""
        from pyro.infer import Predictive

        gen = as_generator(rng_key)
        draws = self.sample(gen, num_samples, client)
        model = self.model if self.model is not None else self.guide.model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
            return Predictive(model, posterior_samples=draws)(*args, **kwargs)

    def mean_and_cov(self) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """Mean and covariance of q over the flat unconstrained vector."""
        return g.to_moments(self.q)

    def to_arviz(self, rng_key: torch.Generator | None = None,  # type: ignore[override]
                 num_samples: int = 1000):
        """An ``xarray.DataTree`` for ArviZ 1.x (:func:`fedppl.arviz.to_inference_data`):
        ``num_samples`` draws of q as 4 chains, the factors per client (needs
        ``pip install 'fedppl[arviz]'``)."""
        from fedppl.arviz import to_inference_data

        gen = torch.Generator().manual_seed(0) if rng_key is None else as_generator(rng_key)
        return to_inference_data(self, gen, num_samples)


def as_generator(rng_key: Any, name: str = "rng_key") -> torch.Generator:
    """A copy of the ``torch.Generator`` ``rng_key`` (the caller's is left as it was)."""
    if not isinstance(rng_key, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator such as "
                        f"torch.Generator().manual_seed(0), got {rng_key!r}")
    gen = torch.Generator()
    gen.set_state(rng_key.get_state())
    return gen
