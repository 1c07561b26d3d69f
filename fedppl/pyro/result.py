"""``PVIResult``: what the Pyro port's ``PVI.run`` returns (torch tensors in the core result's
shape: its history, summary and JSON are :class:`fedppl.infer.base.Result`'s)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedppl.infer.base import Result
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.guides.pvi_guide import PVIGuide

__all__ = ["PVIResult"]


@dataclass(kw_only=True)
class PVIResult(Result):
    """The outcome of a run: the posterior ``q``, the client factors and the per-round
    ``history`` (the NumPyro result's keys: ``round``, ``seconds``, ``messages_up``,
    ``messages_down``, ``bytes_up``, ``bytes_down``, ``rejected``, ``free_energy``, ``converged``,
    ``local_iterations``, ``step``, ``kl_change``, ``elbo``); ``rejected`` lists ``(round,
    client, reason)`` for refused updates and ``unconverged`` ``(round, client)``. The summary
    and the JSON are the core's (:class:`fedppl.infer.base.Result`)."""

    guide: PVIGuide
    q: g.Gaussian
    factors: g.Gaussian
    unconverged: list[tuple[int, str]] = field(default_factory=list)
    local: g.Conditional | None = None
    prior_factor: g.Gaussian | None = None
    model: Callable | None = None

    @property
    def posterior(self) -> dict[str, Any]:
        """Per-site marginal distributions of the global sites (constrained space)."""
        return self.guide.posterior(self.q)

    def check(self, *args: Any, **kwargs: Any):
        """Not yet for Pyro models (the clients' log-likelihoods at the draws are evaluated
        through NumPyro's tracing); write the model in NumPyro to check it."""
        raise NotImplementedError("check and refine are not available for Pyro results yet: the "
                                  "clients' log-likelihoods at the server's draws are evaluated "
                                  "with NumPyro's handlers. Fit the NumPyro version of the model "
                                  "with fedppl.PVI to check it against the pooled posterior")

    def sample(self, rng_key: torch.Generator, num_samples: int,
               client: int | str | None = None) -> dict[str, Tensor]:
        """Joint posterior draws keyed by site name, constrained: ``{name: (num_samples, ...)}``;
        ``client`` (an index or a name) adds that client's local sites."""
        local = None
        if client is not None and self.local is not None:
            local = g.index(self.local, self._client_index(client, self.factors.nat1.shape[0]))
        return self.guide.sample(_generator(rng_key), self.q, num_samples, local)

    def predictive(self, rng_key: torch.Generator, *args: Any, num_samples: int = 1000,
                   client: int | str | None = None, **kwargs: Any) -> dict[str, Tensor]:
        """Posterior predictive draws (Pyro's ``Predictive`` with this posterior's draws)."""
        from pyro.infer import Predictive

        gen = _generator(rng_key)
        draws = self.sample(gen, num_samples, client)
        model = self.model if self.model is not None else self.guide.model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
            return Predictive(model, posterior_samples=draws)(*args, **kwargs)

    def mean_and_cov(self) -> tuple[Tensor, Tensor]:
        """Mean and covariance of q over the flat unconstrained vector."""
        return g.to_moments(self.q)

    def to_arviz(self, rng_key: torch.Generator | None = None, num_samples: int = 1000):
        """An ``xarray.DataTree`` for ArviZ 1.x: ``num_samples`` draws of q as 4 chains, the
        factors per client (see :mod:`fedppl.pyro.arviz`; needs ``pip install 'fedppl[arviz]'``)."""
        from fedppl.pyro.arviz import to_inference_data

        return to_inference_data(self, rng_key, num_samples)


def _generator(rng_key: Any, name: str = "rng_key") -> torch.Generator:
    """A copy of the ``torch.Generator`` ``rng_key`` (the caller's is left as it was)."""
    if not isinstance(rng_key, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator such as "
                        f"torch.Generator().manual_seed(0), got {rng_key!r}")
    gen = torch.Generator()
    gen.set_state(rng_key.get_state())
    return gen
