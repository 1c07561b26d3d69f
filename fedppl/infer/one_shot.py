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
from functools import partial
from typing import Any, ClassVar, cast

import numpy as np
from jax import Array

from fedppl.algorithms import ep, one_shot, pvi, solvers
from fedppl.algorithms.trio import Trio
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.infer.base import FederatedMethod, Plan, RunState, shared
from fedppl.infer.ep import EP, EPResult, ep_record, ep_static, prior_share
from fedppl.infer.pvi_plan import (
    broadcast_bytes,
    initial_states,
    message_bytes,
    refused,
    result,
    set_up,
    start_log,
)
from fedppl.infer.pvi_result import PVIResult

__all__ = ["OneShot", "OneShotResult", "MIXED_RHAT"]

MIXED_RHAT = 1.1  # a subposterior's chains mixed below this split r-hat (whatever max_rhat)


@dataclass(kw_only=True)
class OneShotResult(EPResult):
    """EP's result for the one round: ``q`` the product of the clients' Gaussian approximations
    (consensus: the Gaussian of the merged draws), ``factors`` the clients' approximations over
    ``p^(1/K)`` (to start PVI or EP from), and for consensus ``draws``: the merged draws over the
    flat unconstrained global coordinates ``(n, D)``."""

    method: str = "laplace"
    draws: Array | None = None


class OneShot(FederatedMethod):
    """One round in which every client sends a Gaussian approximation of its subposterior.

    :param model, guide: as for :class:`fedppl.EP` (any prior: one that is not Gaussian in the
        unconstrained space is split over the clients as EP splits it).
    :param method: ``"laplace"`` (mode and Hessian), ``"parametric"`` (moments of NUTS draws,
        multiplied) or ``"consensus"`` (the same draws, sent and merged by consensus Monte Carlo).
    :param num_warmup, num_samples, num_chains, dense_mass, max_rhat, extensions, chain_method:
        the NUTS of the sampled methods, as for :class:`fedppl.EP` (a client whose chains do
        not mix within its extensions sends nothing: its data are then missing from ``q``, and
        the log names it). When most clients' chains did not mix (split r-hat at or above
        ``max_rhat``, or at or above :data:`MIXED_RHAT` where ``max_rhat`` is higher), the run
        raises a ``RuntimeError`` naming them instead of merging: a product or consensus of
        chains stuck in different places is far narrower than the posterior, and nothing in
        it says so.
    :param laplace_steps: L-BFGS steps to the subposterior's mode.
    """

    name = "one-shot"
    schedule = "synchronous"
    # the bar (one round): how far q moved from the prior, the largest site (message)
    progress: ClassVar[tuple[str, ...]] = ("kl_change", "site_change:max")
    tol_objective: ClassVar[str | None] = None  # one round: nothing to stop early

    def __init__(self, model: Callable, guide: PVIGuide, method: str = "laplace", *,
                 num_warmup: int = 300, num_samples: int = 500, num_chains: int = 4,
                 dense_mass: bool = True, max_rhat: float = 1.05, extensions: int = 2,
                 chain_method: str = "sequential", laplace_steps: int = 200,
                 max_divergence: float = pvi.MAX_DIVERGENCE):
        if method not in one_shot.METHODS:
            raise ValueError(f"method must be one of {one_shot.METHODS}, got {method!r}")
        if int(laplace_steps) != laplace_steps or laplace_steps < 1:
            raise ValueError(f"laplace_steps must be a whole number >= 1, got {laplace_steps}")
        # EP's checks of the sampler's settings (the same errors)
        self._ep = EP(model, guide, "synchronous", 1.0, num_warmup=num_warmup,
                      num_samples=num_samples, num_chains=num_chains, dense_mass=dense_mass,
                      max_rhat=max_rhat, extensions=extensions, chain_method=chain_method,
                      max_divergence=max_divergence)
        self.model, self.guide = self._ep.model, guide
        self.num_warmup, self.num_samples = self._ep.num_warmup, self._ep.num_samples
        self.num_chains, self.dense_mass = self._ep.num_chains, self._ep.dense_mass
        self.max_rhat, self.chain_method = self._ep.max_rhat, chain_method
        self.extensions = self._ep.extensions
        self.max_divergence = self._ep.max_divergence
        self.elbo_samples, self.shrink_warning = 0, self._ep.shrink_warning
        self.method, self.laplace_steps = method, int(laplace_steps)
        self.privacy = None  # no private variant (a Flower node asks)

    def _solver(self, model: Callable, guide: PVIGuide, clients: Clients) -> ep.TiltedSolver:
        share = prior_share(guide, clients.num_clients)
        if self.method == "laplace":
            return one_shot.TiltedLaplace(model, guide, self.laplace_steps, prior_share=share)
        ep.check_draws(self.num_samples * self.num_chains, guide.layout_or_raise().dim)
        return ep.TiltedNUTS(model, guide, self.num_warmup, self.num_samples, self.num_chains,
                             self.dense_mass, max_rhat=self.max_rhat,
                             chain_method=self.chain_method, prior_share=share,
                             keep_draws=self.method == "consensus", extensions=self.extensions)

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              factors: g.Gaussian | None = None, resume: PVIResult | None = None,
              **model_kwargs: Any) -> Plan:
        if factors is not None or resume is not None:
            raise ValueError("a one-shot merge starts from the prior: no factors or resume")
        model = solvers.bind(self.model, model_kwargs)
        guide = set_up(self.guide, clients, model_kwargs)
        solver = self._solver(model, guide, clients)
        K = clients.num_clients
        server, cstates = initial_states(guide, K, None, None, False)
        trio = shared(_one_shot_trio, solver, guide, K, self.max_divergence)
        static = ep_static(self, guide, model, solver, clients, rho=1.0, one_shot=self.method)
        record = partial(_record, min(self.max_rhat, MIXED_RHAT), self.method)
        return Plan(trio, self.schedule, server, cstates, record, _result, log=start_log(K),
                    rng_key=rng_key, static=static, about=guide.describe())

    def _message_bytes(self, msgs) -> int:
        extra = 0 if msgs.draws is None else msgs.draws[0].nbytes
        return message_bytes(msgs) + extra

    _broadcast_bytes = staticmethod(broadcast_bytes)  # as PVI's (fedppl.infer.variational)
    _refused = staticmethod(refused)

    def init(self, rng_key: Array, clients: Clients, factors: g.Gaussian | None = None, *,
             resume: PVIResult | None = None, runtime: Any = None,
             **model_kwargs: Any) -> RunState:
        """Set up the round (keyword arguments are the model's)."""
        return super().init(rng_key, clients, runtime=runtime, factors=factors, resume=resume,
                            **model_kwargs)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int = 1, *,
            progress_bar: bool = True, runtime: Any = None,
            **model_kwargs: Any) -> OneShotResult:
        """The one round (``num_rounds`` must be 1); keyword arguments are the model's."""
        if num_rounds != 1:
            raise ValueError(f"a one-shot method runs one round, got num_rounds={num_rounds}")
        state = self.init(rng_key, clients, runtime=runtime, **model_kwargs)
        return cast(OneShotResult, self._loop(state, 1, progress_bar))


def _one_shot_trio(solver: ep.TiltedSolver, guide: PVIGuide, num_clients: int,
                   max_divergence: float) -> Trio:
    """The one-shot trio (made once per settings and guide through
    :func:`fedppl.infer.base.shared`: its round compiles once)."""
    return one_shot.make_trio(solver, guide.prior_or_raise(), num_clients,
                              max_divergence=max_divergence)


def check_mixed(rhat: np.ndarray, names: list[str], limit: float, method: str) -> None:
    """Refuse a merge in which most clients' subposterior chains did not mix (split r-hat at or
    above ``limit``; NaN, a closed form, counts as mixed), naming them."""
    rhat = np.asarray(rhat, float)
    bad = np.nonzero(rhat >= limit)[0]
    if len(bad) * 2 > len(rhat):
        listed = ", ".join(f"{names[k]} ({rhat[k]:.3g})" for k in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise RuntimeError(
            f"OneShot({method!r}): the chains of {len(bad)} of {len(rhat)} clients did not mix "
            f"(split r-hat at or above {limit:.3g}: {listed}{more}), so their subposterior "
            "moments are those of chains stuck apart and a merge of them would be far narrower "
            "than the posterior. Raise num_warmup and num_samples (or extensions), "
            "reparametrise the model (non-centred group effects), or use an iterative method "
            "that samples near the posterior: fedppl.EP, from PVI's factors if its first "
            "rounds do not mix, or fedppl.PVI")


def _record(limit: float, method: str, before: RunState, after: RunState, msgs: Any,
            steps: Array, active: np.ndarray, rng_key: Array) -> tuple[Any, dict[str, Any]]:
    """EP's history row; a consensus merge's draws (the server's) kept in the log. Refused
    (:func:`check_mixed`) when most subposteriors did not mix."""
    if method != "laplace":
        assert after.plan is not None  # a started run's state
        check_mixed(np.asarray(msgs.rhat)[np.asarray(active, bool)],
                    [n for n, a in zip(after.plan.names, np.asarray(active), strict=True) if a],
                    limit, method)
    log, row = ep_record(before, after, msgs, steps, active, rng_key)
    assert after.plan is not None  # a started run's state
    if after.plan.static.one_shot == "consensus":  # the server's merge of the clients' draws
        sent = np.asarray(active) & np.asarray(msgs.converged, bool)
        log = log._replace(merged=one_shot.consensus_draws(msgs.draws[np.nonzero(sent)[0]],
                                                           rng_key))
    return log, row


def _result(state: RunState, history: dict[str, np.ndarray],
            rejected: list[tuple[int, str, str]]) -> OneShotResult:
    assert state.plan is not None  # a started run's state
    res: PVIResult = result(state, history, rejected)
    guide, merged = state.plan.static.guide, state.log.method.merged
    out = OneShotResult(**{f.name: getattr(res, f.name) for f in fields(res)},
                        method=state.plan.static.one_shot)
    if merged is not None:
        n = merged.shape[0]
        mean = merged.mean(axis=0)
        centred = merged - mean
        fit = g.FullGaussian.from_moments(mean, centred.T @ centred / (n - 1))
        out.q = g.project_diag(fit) if guide.diag else fit
        out.draws = merged
    return out
