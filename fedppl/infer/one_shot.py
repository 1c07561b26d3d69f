"""``OneShot``: the one-round baselines (Laplace, parametric, consensus) with EP's front.

Each client approximates its subposterior ``p(theta)^(1/K) p(y_k | theta)`` once; the server
multiplies the Gaussian approximations (Laplace, parametric) or merges the draws (consensus): see
:mod:`fedppl.algorithms.one_shot`. The result's ``factors`` are the clients' approximations as
sites, where PVI or EP can start instead of at the prior.

Example (the Laplace one-shot of a Bayesian linear regression is its exact posterior; EP then
starts there)::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> guide = fedppl.PVIGuide(model, family="fullrank")
    >>> laplace = fedppl.OneShot(model, guide, "laplace").run(jax.random.key(0), clients)
    >>> ep = fedppl.EP(model, guide, tilted="exact").run(
    ...     jax.random.key(1), clients, 1, factors=laplace.factors, progress_bar=False)
    >>> bool(np.allclose(ep.mean_and_cov()[0], laplace.mean_and_cov()[0], atol=1e-6))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, cast

import numpy as np
from jax import Array

from fedppl.algorithms import ep, one_shot, pvi
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.infer.ep import EP, EPResult
from fedppl.infer.variational import PVI, PVIResult

__all__ = ["OneShot", "OneShotResult"]


@dataclass(kw_only=True)
class OneShotResult(EPResult):
    """EP's result for the one round: ``q`` the product of the clients' Gaussian approximations
    (consensus: the Gaussian of the merged draws), ``factors`` the clients' approximations over
    ``p^(1/K)`` (to start PVI or EP from), and for consensus ``draws``: the merged draws over the
    flat unconstrained global coordinates ``(n, D)``."""

    method: str = "laplace"
    draws: Array | None = None


class OneShot(EP):
    """One round in which every client sends a Gaussian approximation of its subposterior.

    :param model, guide: as for :class:`fedppl.EP` (any prior: one that is not Gaussian in the
        unconstrained space is split over the clients as EP splits it).
    :param method: ``"laplace"`` (mode and Hessian), ``"parametric"`` (moments of NUTS draws,
        multiplied) or ``"consensus"`` (the same draws, sent and merged by consensus Monte Carlo).
    :param num_warmup, num_samples, num_chains, dense_mass, max_rhat, chain_method: the NUTS of
        the sampled methods, as for :class:`fedppl.EP` (a client whose chains do not mix sends
        nothing: its data are then missing from ``q``, and the log names it).
    :param laplace_steps: L-BFGS steps to the subposterior's mode.
    """

    name = "one-shot"
    # the bar (one round): how far q moved from the prior, the largest site (message)
    progress: ClassVar[tuple[str, ...]] = ("kl_change", "site_change:max")
    tol_objective: ClassVar[str | None] = None  # one round: nothing to stop early

    def __init__(self, model: Callable, guide: PVIGuide, method: str = "laplace", *,
                 num_warmup: int = 300, num_samples: int = 500, num_chains: int = 4,
                 dense_mass: bool = True, max_rhat: float = 1.05,
                 chain_method: str = "sequential", laplace_steps: int = 200,
                 max_divergence: float = pvi.MAX_DIVERGENCE):
        if method not in one_shot.METHODS:
            raise ValueError(f"method must be one of {one_shot.METHODS}, got {method!r}")
        if int(laplace_steps) != laplace_steps or laplace_steps < 1:
            raise ValueError(f"laplace_steps must be a whole number >= 1, got {laplace_steps}")
        super().__init__(model, guide, "synchronous", 1.0, num_warmup=num_warmup,
                         num_samples=num_samples, num_chains=num_chains, dense_mass=dense_mass,
                         max_rhat=max_rhat, chain_method=chain_method,
                         max_divergence=max_divergence)
        self.method, self.laplace_steps = method, int(laplace_steps)
        self._merged: Array | None = None  # consensus: the server's merged draws

    def _solver(self, clients: Clients, model: Callable, model_kwargs: dict):
        guide, share = self._prepare(clients, model_kwargs)
        if self.method == "laplace":
            self._ep_solver: ep.TiltedSolver = one_shot.TiltedLaplace(
                model, guide, self.laplace_steps, prior_share=share)
        else:
            ep.check_draws(self.num_samples * self.num_chains, guide._require_setup().dim)
            self._ep_solver = ep.TiltedNUTS(
                model, guide, self.num_warmup, self.num_samples, self.num_chains,
                self.dense_mass, max_rhat=self.max_rhat, chain_method=self.chain_method,
                prior_share=share, keep_draws=self.method == "consensus")
        return cast(pvi.LocalSolver, self._ep_solver), None

    def _setup(self, rng_key: Array, clients: Clients, factors=None, resume=None,
               **model_kwargs: Any):
        if factors is not None or resume is not None:
            raise ValueError("a one-shot merge starts from the prior: no factors or resume")
        _, schedule, server, cstates = PVI._setup(self, rng_key, clients, **model_kwargs)
        key = ("one-shot", self._ep_solver, clients.num_clients)
        if key not in self._compiled:
            self._compiled[key] = one_shot.make_trio(self._ep_solver, self.guide._require_prior(),
                                                     clients.num_clients,
                                                     max_divergence=self.max_divergence)
        self._rho, self._merged = 1.0, None
        return self._compiled[key], schedule, server, cstates

    def _record(self, before, after, msgs, steps, active, rng_key) -> dict[str, Any]:
        row = super()._record(before, after, msgs, steps, active, rng_key)
        if self.method == "consensus":  # the server's merge of the clients' draws
            sent = np.asarray(active) & np.asarray(msgs.converged, bool)
            self._merged = one_shot.consensus_draws(msgs.draws[np.nonzero(sent)[0]], rng_key)
        return row

    def _message_bytes(self, msgs) -> int:
        extra = 0 if msgs.draws is None else msgs.draws[0].nbytes
        return super()._message_bytes(msgs) + extra

    def run(self, rng_key: Array, clients: Clients, num_rounds: int = 1, *,
            progress_bar: bool = True, **model_kwargs: Any) -> OneShotResult:
        """The one round (``num_rounds`` must be 1); keyword arguments are the model's."""
        if num_rounds != 1:
            raise ValueError(f"a one-shot method runs one round, got num_rounds={num_rounds}")
        return cast(OneShotResult, super().run(rng_key, clients, 1, progress_bar=progress_bar,
                                               **model_kwargs))

    def _result(self, state, history, rejected) -> OneShotResult:
        res: PVIResult = super()._result(state, history, rejected)
        out = OneShotResult(**{f.name: getattr(res, f.name) for f in fields(res)},
                            method=self.method)
        if self._merged is not None:
            n = self._merged.shape[0]
            mean = self._merged.mean(axis=0)
            centred = self._merged - mean
            fit = g.FullGaussian.from_moments(mean, centred.T @ centred / (n - 1))
            out.q = g.project_diag(fit) if self.guide.diag else fit
            out.draws = self._merged
        return out
