"""``EP`` for Pyro models: the core's :class:`fedppl.EP` (its server, damping schedules, the
clients' NUTS on their tilted distributions, the round log and the result) with what touches
Pyro swapped in: the clients are checked against the Pyro model by tracing it with
``pyro.poutine``, each tilted distribution's log density, gradient and Hessian are evaluated by
torch (:class:`fedppl.pyro.PVIGuide`), and ``tilted="exact"`` reads the likelihood terms with
torch. ``rng_key`` is a ``torch.Generator``; the result holds torch tensors.

Example (Bayesian linear regression with the tilted moments in closed form: one undamped round
is the exact posterior)::

    >>> import numpy as np, torch, pyro, pyro.distributions as dist, fedppl
    >>> import fedppl.pyro as fp
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> X = np.random.default_rng(0).normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> ep = fp.EP(model, fp.PVIGuide(model, family="fullrank", dtype=torch.float32),
    ...            damping=1.0, tilted="exact")
    >>> result = ep.run(torch.Generator().manual_seed(0), clients, 1, progress_bar=False)
    >>> exact = np.linalg.solve(np.eye(2) + X.T @ X, X.T @ (X @ np.ones(2)))
    >>> bool(np.allclose(result.mean_and_cov()[0].numpy(), exact, atol=1e-4))
    True
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import torch

from fedppl.algorithms import ep
from fedppl.clients import Clients
from fedppl.infer import ep as core
from fedppl.infer.base import Plan, RunState
from fedppl.pyro.algorithms.conjugate import ConjugateSolver
from fedppl.pyro.algorithms.conjugate import check as conjugate_check
from fedppl.pyro.bridge import to_jax
from fedppl.pyro.checks import check_clients
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.client import client
from fedppl.pyro.result import PVIResult, in_torch, jax_key
from fedppl.pyro.sites import cast_floats

__all__ = ["EP", "EPResult"]

RESUMED = ("factors", "prior_factor", "local")  # what resume= takes from a result


@dataclass(kw_only=True)
class EPResult(PVIResult, core.EPResult):
    """EP's result (:class:`fedppl.infer.ep.EPResult`: EP's history columns) in torch, as the
    port's :class:`~fedppl.pyro.PVIResult`."""


class ExactTilted(ep.ExactTilted):
    """The core's closed-form tilted moments, the likelihood terms read from the Pyro model by
    torch (:class:`fedppl.pyro.algorithms.conjugate.ConjugateSolver`)."""

    __slots__ = ()

    def terms(self, data: tuple, mask: Any) -> Any:
        return ConjugateSolver(self.model, self.guide).terms(data, mask)


class EP(core.EP):
    """Expectation propagation over the global sites of a Pyro model; the arguments are those
    of :class:`fedppl.EP` (see it)."""

    def _tilted_solver(self, model: Callable, guide: PVIGuide,  # type: ignore[override]
                       share: Any, clients: Clients) -> ep.TiltedSolver:
        if self.tilted != "exact":  # NUTS on the log density the guide evaluates with torch
            return super()._tilted_solver(model, guide, share, clients)
        if share is not None:
            raise ValueError("tilted='exact' needs a prior that is Gaussian in the "
                             "unconstrained space of the global sites")
        layout = guide.layout_or_raise()
        data = cast_floats(clients.client(0), layout.dtype)
        mask = torch.ones(len(data[0]), dtype=torch.bool)
        why = (conjugate_check(client(model, mask=mask), layout, *data)
               if guide.local_layout is None else "the model has local latent sites")
        if why is not None:
            raise ValueError(f"tilted='exact' needs a Gaussian likelihood affine in the "
                             f"global sites: {why}")
        return ExactTilted(model, guide)

    def _set_up(self, clients: Clients, model_kwargs: dict) -> PVIGuide:
        """The guide set up on the clients, checked against the Pyro model."""
        guide = cast(PVIGuide, self.guide).setup(*clients.client(0), **model_kwargs)
        check_clients(guide, clients, model_kwargs)
        return copy.copy(guide)

    def _plan(self, rng_key: Any, clients: Clients, *, data_at_server: bool = True,
              factors: Any = None, resume: Any = None, **model_kwargs: Any) -> Plan:
        """The core's EP plan on torch's factors or result, its result in torch."""
        if resume is not None:
            resume = SimpleNamespace(**to_jax({k: getattr(resume, k) for k in RESUMED}))
        plan = super()._plan(rng_key, clients, data_at_server=data_at_server,
                             factors=to_jax(factors), resume=resume, **model_kwargs)
        return plan._replace(result=_torch_result)

    def init(self, rng_key: torch.Generator, clients: Clients,  # type: ignore[override]
             factors: Any = None, *, resume: PVIResult | None = None, runtime: Any = None,
             **model_kwargs: Any) -> RunState:
        """As :meth:`fedppl.EP.init`, with ``rng_key`` a ``torch.Generator``."""
        return super().init(jax_key(rng_key), clients, factors, resume=resume,
                            runtime=runtime, **model_kwargs)

    def run(self, rng_key: torch.Generator, clients: Clients,  # type: ignore[override]
            num_rounds: int, **kwargs: Any) -> EPResult:
        """As :meth:`fedppl.EP.run`, with ``rng_key`` a ``torch.Generator``."""
        return cast(EPResult, super().run(jax_key(rng_key), clients, num_rounds, **kwargs))


def _torch_result(state: RunState, history: dict, rejected: list) -> EPResult:
    return in_torch(core.ep_result(state, history, rejected), EPResult)
