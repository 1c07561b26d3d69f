"""``PVIResult``: what the Pyro port's ``PVI.run`` returns, the core's
:class:`fedppl.infer.variational.PVIResult` with torch tensors (``q``, the factors, the private
guides) and torch's randomness (``rng_key`` a ``torch.Generator``); its history, summary, JSON and
ArviZ export are the core's. Its ``check`` and ``refine`` are the core's too (the clients'
log-likelihoods at the server's draws evaluated by torch through the guide), returning the
core's :class:`ImportanceResult` and :class:`SMCResult` read in torch."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, cast

import jax
import torch
from torch import Tensor

from fedppl.infer import importance, smc
from fedppl.infer.pvi_result import PVIResult as CoreResult
from fedppl.pyro.bridge import to_jax, to_torch
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.guides.pvi_guide import PVIGuide

__all__ = ["PVIResult", "ImportanceResult", "SMCResult", "in_torch"]

ARRAYS = ("q", "factors", "local", "prior_factor")  # a result's arrays that are torch's


@dataclass(kw_only=True)
class PVIResult(CoreResult):
    """The outcome of a run (see :class:`fedppl.PVIResult`), in torch."""

    def check(self, rng_key: torch.Generator, clients: Any,  # type: ignore[override]
              num_draws: int = 1000, *, progress_bar: bool = False, **kwargs: Any
              ) -> ImportanceResult:
        """:meth:`fedppl.PVIResult.check` (the same arguments, ``rng_key`` a
        ``torch.Generator``): Pareto k-hat, ESS and corrected moments of ``q`` against the
        pooled posterior, each client's log-likelihoods at the draws evaluated by torch."""
        out = self._core().check(jax_key(rng_key), clients, num_draws,
                                 progress_bar=progress_bar, **kwargs)
        return ported(out)

    def refine(self, rng_key: torch.Generator, clients: Any,  # type: ignore[override]
               num_rounds: int | None = None, num_draws: int = 1000, *,
               method: str | None = None, progress_bar: bool = True, **kwargs: Any
               ) -> ImportanceResult | SMCResult:
        """:meth:`fedppl.PVIResult.refine` (the same arguments and choice of method,
        ``rng_key`` a ``torch.Generator``): the pooled posterior from this answer, by the
        importance refinement or the SMC sampler."""
        out = self._core().refine(jax_key(rng_key), clients, num_rounds, num_draws,
                                  method=method, progress_bar=progress_bar, **kwargs)
        return ported(out)

    def _core(self) -> CoreResult:
        """This result with JAX arrays, as the core's check and sampler take it."""
        values = {f.name: getattr(self, f.name) for f in fields(CoreResult)}
        values.update(to_jax({k: values[k] for k in ARRAYS}))
        return CoreResult(**values)

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
        """An ``xarray.DataTree`` for ArviZ 1.x (:meth:`fedppl.PVIResult.to_arviz`):
        ``num_samples`` draws of q as 4 chains, the factors per client (needs
        ``pip install 'fedppl[arviz]'``)."""
        gen = torch.Generator().manual_seed(0) if rng_key is None else as_generator(rng_key)
        return CoreResult.to_arviz(self, gen, num_samples)  # type: ignore[arg-type]


@dataclass(kw_only=True)
class ImportanceResult(importance.ImportanceResult):
    """The check's weighted draws (:class:`fedppl.infer.importance.ImportanceResult`), with
    ``rng_key`` a ``torch.Generator`` and draws as torch tensors."""

    def sample(self, rng_key: torch.Generator,  # type: ignore[override]
               num_samples: int) -> dict[str, Tensor]:
        """Draws resampled by their weights, constrained, keyed by site name."""
        return cast(dict[str, Tensor], super().sample(jax_key(rng_key), num_samples))

    def to_arviz(self, rng_key: torch.Generator | None = None,  # type: ignore[override]
                 num_samples: int = 1000):
        """As the core's (:meth:`fedppl.infer.importance.ImportanceResult.to_arviz`)."""
        return super().to_arviz(None if rng_key is None else jax_key(rng_key), num_samples)


@dataclass(kw_only=True)
class SMCResult(smc.SMCResult):
    """The sampler's particles (:class:`fedppl.infer.smc.SMCResult`), with ``rng_key`` a
    ``torch.Generator``, draws as torch tensors and Pyro's ``Predictive``."""

    def sample(self, rng_key: torch.Generator,  # type: ignore[override]
               num_samples: int) -> dict[str, Tensor]:
        """``num_samples`` particles drawn uniformly with replacement, constrained."""
        return cast(dict[str, Tensor], super().sample(jax_key(rng_key), num_samples))

    def predictive(self, rng_key: torch.Generator, *args: Any,  # type: ignore[override]
                   num_samples: int = 1000, **kwargs: Any) -> dict[str, Tensor]:
        """Posterior predictive draws (Pyro's ``Predictive`` with the particles)."""
        from pyro.infer import Predictive

        gen = as_generator(rng_key)
        draws = self.sample(gen, num_samples)
        model = self.model if self.model is not None else self.guide.model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
            return Predictive(model, posterior_samples=draws)(*args, **kwargs)


def in_torch(result: Any, cls: type) -> Any:
    """A core result with a Gaussian ``q`` as the port's ``cls``: ``q``, the factors, the
    private guides and the prior factor as torch tensors, the rest as they are."""
    values = {f.name: getattr(result, f.name) for f in fields(result)}
    values.update(to_torch({k: values[k] for k in ARRAYS}))
    return cls(**values)


def ported(result: Any) -> Any:
    """The core's importance or sampler result as the port's (the same fields)."""
    cls = {importance.ImportanceResult: ImportanceResult, smc.SMCResult: SMCResult}
    port = cls[type(result)]
    return port(**{f.name: getattr(result, f.name) for f in fields(result)})


def jax_key(rng_key: Any) -> jax.Array:
    """A JAX key drawn from (a copy of) the ``torch.Generator`` ``rng_key``; a JAX key (what
    a runtime such as Flower's hands every method) as it is."""
    if isinstance(rng_key, jax.Array) and jax.dtypes.issubdtype(rng_key.dtype,
                                                                 jax.dtypes.prng_key):
        return rng_key
    gen = as_generator(rng_key)
    return jax.random.key(int(torch.randint(2**31 - 1, (1,), generator=gen)))


def as_generator(rng_key: Any, name: str = "rng_key") -> torch.Generator:
    """A copy of the ``torch.Generator`` ``rng_key`` (the caller's is left as it was)."""
    if not isinstance(rng_key, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator such as "
                        f"torch.Generator().manual_seed(0), got {rng_key!r}")
    gen = torch.Generator()
    gen.set_state(rng_key.get_state())
    return gen
