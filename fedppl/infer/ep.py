"""``EP``: federated expectation propagation on a NumPyro model (Vehtari et al. 2020).

A front of its own that composes PVI's pieces (:mod:`fedppl.infer.variational`: the set-up and
checks of the guide, the initial states, the history row, the result) with EP's client step:
each client samples its tilted distribution ``cavity * likelihood^alpha`` with NUTS and sends
the change of its Gaussian site (see :mod:`fedppl.algorithms.ep`). The server, the message
checks, the round log and the result are PVI's.

Example (Bayesian linear regression, the tilted moments in closed form, so one undamped round is
the exact posterior; ``tilted="nuts"``, the default, samples them)::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> ep = fedppl.EP(model, fedppl.PVIGuide(model, family="fullrank"), damping=1.0,
    ...                tilted="exact")
    >>> result = ep.run(jax.random.key(0), clients, num_rounds=1, progress_bar=False)
    >>> sorted(result.history)[:4]
    ['bytes_down', 'bytes_up', 'converged', 'damping']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import validation
from fedppl.algorithms import conjugate, ep, pvi, solvers
from fedppl.algorithms.trio import Trio
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.infer.base import (
    FederatedMethod,
    Plan,
    RunState,
    StopRule,
    check_rounds,
    check_tol,
    shared,
)
from fedppl.infer.pvi_plan import (
    SOLVERS,
    Static,
    broadcast_bytes,
    elbo_fn,
    flat_factors,
    initial_states,
    kl_tol_rule,
    message_bytes,
    record,
    refused,
    result,
    set_up,
    start_log,
)
from fedppl.infer.pvi_result import PVIResult
from fedppl.model_call import positional
from fedppl.runtime.embedded import SCHEDULES

__all__ = ["EP", "EPResult"]


@dataclass(frozen=True)
class _Share:
    """A client's share ``weight * correction(theta)`` of the prior's departure from its Gaussian
    base (``p = p~ exp(correction)``): EP splits it evenly over the K clients' tilted
    distributions, so that ``p~ prod_k [p(y_k | theta) exp(correction / K)]`` is the exact
    posterior. Hashable, so that equal shares reuse a compiled round."""

    correction: Callable[[Array], Array]
    weight: float

    def __call__(self, theta: Array) -> Array:
        return self.weight * self.correction(theta)

TILTED = ("nuts", "exact")
ESTIMATORS = ("sample", "stein")


@dataclass(kw_only=True)
class EPResult(PVIResult):
    """PVI's result (``q``, the sites as ``factors``, ``sample``, ``to_arviz``...) with EP's
    history: ``rhat`` and ``ess`` (rounds, K) the largest split r-hat and smallest effective
    sample size over the global coordinates of each client's tilted draws, ``mc_error``
    (rounds, K) the largest Monte Carlo standard error of a tilted mean in tilted sds,
    ``site_change`` (rounds, K) the largest absolute change of a natural parameter of each
    client's site (its message), ``extensions`` (rounds, K) how many extra sampler stages each
    client's chains took to mix (``max_rhat``),
    ``damping`` (rounds) the damping each round used. ``free_energy`` is NaN (EP has none);
    ``converged`` is whether r-hat stayed below ``max_rhat``; ``local_iterations`` the draws
    (chains times samples)."""

    client_stats: ClassVar[tuple[str, ...]] = ("rhat", "ess", "mc_error", "extensions")


class EP(FederatedMethod):
    """Expectation propagation over the global sites of a NumPyro model.

    :param model: an ordinary NumPyro model (as for :class:`fedppl.PVI`), with any prior: a
        prior that is not Gaussian in the unconstrained space (HalfCauchy, Laplace, a scale
        that is another site...) is split evenly over the clients' tilted distributions,
        ``p = p~ exp(c)`` with ``p~`` its Gaussian base (``guide.prior``) in q and
        ``exp(c / K)`` beside each client's likelihood, so the target stays the exact posterior.
        Local latent sites are sampled jointly with the global ones in each tilted distribution;
        they never leave the client, which keeps ``q(z_k | theta)``, the Gaussian conditional of
        its last round's joint draws (``result.local``; ``result.sample(key, n, client=k)``).
    :param guide: a :class:`~fedppl.guides.PVIGuide` (``family="fullrank"`` for full-rank sites,
        ``"meanfield"`` matches the tilted marginals only).
    :param schedule: ``"synchronous"`` (default: every client's sampler in one compiled round,
        vmapped over clients), ``"sequential"`` or ``"loop"``.
    :param damping: ``rho`` in (0, 1]; a function of the server's round counter (from 0) that
        JAX can trace, such as :func:`fedppl.algorithms.ep.decaying_damping` (``run`` checks
        its value at every round it will run, and ``update`` each round's before applying it:
        a value outside (0, 1] is an error naming the round); or
        ``"decaying"`` (default): ep-stan's schedule, from 0.5 towards ``min(1 / K, 0.2)`` for ``K``
        clients (rate 0.8 per round); with ``estimator="stein"`` from 0.5 towards 0.1 (rate 0.9)
        whatever ``K``, since each site's noise shrinks with the site. The Monte Carlo noise of
        the sites sets a floor on q's error that a constant damping keeps high (see the
        ep_vs_pvi benchmark page in the docs); a floor of ``1 / K`` leaves EP crawling at
        ``K = 100`` once its sites are precise.
    :param num_warmup, num_samples, num_chains: NUTS per client and round; the draws,
        ``num_samples * num_chains``, must be at least ``2 D + 10`` for ``D`` global coordinates.
        Each round's chains start at draws of ``q`` (with local sites: of ``q`` times the
        client's ``q(z_k | theta)`` from its previous round) with that Gaussian's covariance as
        the inverse mass matrix, which warm-up adapts further: the previous round's adaptation
        carried over. The step size is found afresh.
    :param alpha: power EP's ``alpha`` in (0, 1]: the tilted distribution takes the likelihood to
        the power ``alpha``, the site update ``1 / alpha`` (1: plain EP).
    :param dense_mass: adapt a dense (True) or diagonal mass matrix in warm-up.
    :param max_rhat: a client whose chains reach this largest split r-hat over the global
        coordinates runs them further (``extensions``); if they still reach it, it skips its
        update that round (its site and local guide stay as they were, its message is a zero
        change) and is recorded as not converged (``history["converged"]``, and in
        ``result.unconverged``).
    :param extensions: the budget of extra sampler stages for a client whose chains did not mix
        (default 2): each is ``num_warmup`` further adaptation steps and ``num_samples`` fresh
        draws per chain, continuing from where the chains stopped with the step size and mass
        matrix they had adapted; the last stage's draws are used. ``history["extensions"]``
        records how many each client took. Under the synchronous schedule the clients share
        one compiled round, so a round lasts as long as its most extended client. 0: skip at
        once.
    :param tilted: ``"nuts"`` or ``"exact"`` (closed form, for a Gaussian likelihood affine in
        the global sites: to check the algebra).
    :param chain_method: ``"sequential"`` or ``"vectorized"`` chains (see
        :class:`~fedppl.algorithms.ep.TiltedNUTS`).
    :param estimator: how the tilted moments are estimated from the draws: ``"stein"``
        (default: from the gradients and Hessians of the client's log likelihood at the draws,
        by Stein's identities, :func:`fedppl.algorithms.ep.stein_moments`, along the directions
        where the site is weaker than its cavity, and the sample moments along the rest,
        :func:`fedppl.algorithms.ep.blend_moments`) or ``"sample"`` (the draws' mean and
        covariance, with the inverse-Wishart correction of the precision). Stein's estimate is
        noisy in proportion to the client's own site rather than to the cavity, so its error in
        q does not grow with the number of clients as the sample moments' does (see the
        ep_vs_pvi benchmark page in the docs: the defaults meet 0.05 sd at ``K = 10`` and 0.1
        sd at ``K = 100`` on breast cancer, where ``"sample"`` misses both). It costs a Hessian
        over the global coordinates per draw.
    :param elbo_samples: draws for a global ELBO of ``q`` per round (0, the default, skips it).
    :param clients_per_round, shrink_warning, max_divergence: as for :class:`fedppl.PVI`.
    """

    name = "EP"
    # the bar: how far q moved and the largest change of a client's site (its message)
    progress: ClassVar[tuple[str, ...]] = ("elbo", "kl_change", "site_change:max")
    tol_objective: ClassVar[str | None] = "kl_change"

    def __init__(self, model: Callable, guide: PVIGuide, schedule: str = "synchronous",
                 damping: float | str | Callable[[Array], Array] = "decaying", *,
                 num_warmup: int = 300,
                 num_samples: int = 500, num_chains: int = 4, alpha: float = 1.0,
                 dense_mass: bool = True, max_rhat: float = 1.05, tilted: str = "nuts",
                 chain_method: str = "sequential", estimator: str = "stein",
                 extensions: int = 2, elbo_samples: int = 0,
                 clients_per_round: int | None = None, shrink_warning: float = 2.0,
                 max_divergence: float = pvi.MAX_DIVERGENCE):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if isinstance(damping, str) and damping != "decaying":
            raise ValueError(f"damping must be a number, a function or 'decaying', got "
                             f"{damping!r}")
        first = (0.5 if isinstance(damping, str) else
                 float(damping(jnp.asarray(0))) if callable(damping) else damping)
        if not 0.0 < first <= 1.0:
            raise ValueError(f"damping must be in (0, 1], got {first}"
                             + (" (the schedule's value at round 0)" if callable(damping) else ""))
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha (power EP) must be in (0, 1], got {alpha}")
        for name, value, least in (("num_warmup", num_warmup, 1), ("num_samples", num_samples, 4),
                                   ("num_chains", num_chains, 1), ("extensions", extensions, 0)):
            if int(value) != value or value < least:
                raise ValueError(f"{name} must be a whole number >= {least}, got {value}")
        if tilted not in TILTED:
            raise ValueError(f"tilted must be one of {TILTED}, got {tilted!r}")
        if chain_method not in ("sequential", "vectorized"):
            raise ValueError(f"chain_method must be 'sequential' or 'vectorized', got "
                             f"{chain_method!r}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if not max_rhat > 1:
            raise ValueError(f"max_rhat must be > 1, got {max_rhat}")
        # PVI's checks of the settings EP shares with it (the same errors)
        validation.pvi_settings(first, False, "natural-gradient", SOLVERS, None, None, None,
                                shrink_warning, max_divergence)
        if clients_per_round is not None and clients_per_round < 1:
            raise ValueError(f"clients_per_round must be positive, got {clients_per_round}")
        self.model = positional(model)  # data arguments may be keyword-only
        self.guide = guide
        self.schedule = schedule
        self.damping = float(first)
        self.ep_damping = damping
        self.alpha = float(alpha)
        self.tilted = tilted
        self.num_warmup, self.num_samples = int(num_warmup), int(num_samples)
        self.num_chains, self.dense_mass = int(num_chains), bool(dense_mass)
        self.max_rhat, self.chain_method = float(max_rhat), chain_method
        self.estimator = estimator
        self.extensions = int(extensions)
        self.elbo_samples = int(elbo_samples)
        self.clients_per_round = clients_per_round
        self.shrink_warning = float(shrink_warning)
        self.max_divergence = float(max_divergence)
        self.privacy = None  # EP has no private variant (a Flower node asks)

    def init_factors(self, num_clients: int) -> g.Gaussian:
        """Flat sites ``t_k = 1`` for every client (q starts at the prior)."""
        return flat_factors(self.guide.prior_or_raise(), num_clients)

    # -- the plan ------------------------------------------------------------------------------

    def _tilted_solver(self, model: Callable, guide: PVIGuide, share: _Share | None,
                       clients: Clients) -> ep.TiltedSolver:
        """The clients' tilted-moment step: NUTS, or the closed form (``tilted="exact"``)."""
        layout = guide.layout_or_raise()
        if self.tilted == "exact":
            if share is not None:
                raise ValueError("tilted='exact' needs a prior that is Gaussian in the "
                                 "unconstrained space of the global sites")
            data, mask = clients.padded(0)
            why = (conjugate.check(client(model, mask=mask), layout, *data)
                   if guide.local_layout is None else "the model has local latent sites")
            if why is not None:
                raise ValueError(f"tilted='exact' needs a Gaussian likelihood affine in the "
                                 f"global sites: {why}")
            return ep.ExactTilted(model, guide)
        ep.check_draws(self.num_samples * self.num_chains, layout.dim)
        return ep.TiltedNUTS(model, guide, self.num_warmup, self.num_samples, self.num_chains,
                             self.dense_mass, max_rhat=self.max_rhat,
                             chain_method=self.chain_method, prior_share=share,
                             estimator=self.estimator, extensions=self.extensions)

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              factors: g.Gaussian | None = None, resume: PVIResult | None = None,
              **model_kwargs: Any) -> Plan:
        model = solvers.bind(self.model, model_kwargs)
        guide = self._set_up(clients, model_kwargs)
        solver = self._tilted_solver(model, guide, prior_share(guide, clients.num_clients),
                                     clients)
        K = clients.num_clients
        server, cstates = initial_states(guide, K, factors, resume, False)
        damping = self.ep_damping
        trio, rho = shared(_ep_trio, solver, damping, self.estimator,
                           K if isinstance(damping, str) else None, guide, self.alpha,
                           self.schedule, self.max_divergence)
        static = ep_static(self, guide, model, solver, clients, rho=rho)
        return Plan(trio, self.schedule, server, cstates, ep_record, ep_result,
                    log=start_log(K), rng_key=rng_key, static=static, about=guide.describe())

    def _set_up(self, clients: Clients, model_kwargs: dict) -> PVIGuide:
        """The guide set up on the clients, checked against the model (a copy the run keeps)."""
        return set_up(self.guide, clients, model_kwargs)

    # what the PVI family sends and refuses (fedppl.infer.variational)
    _message_bytes = staticmethod(message_bytes)
    _broadcast_bytes = staticmethod(broadcast_bytes)
    _refused = staticmethod(refused)

    def _tol_rule(self, tol: float | None) -> StopRule | None:
        return kl_tol_rule(tol)

    # -- the damping schedule, checked before it is applied ------------------------------------

    def _updates_per_round(self, num_clients: int) -> int:
        """Server updates (steps of the damping schedule's counter) in one round."""
        if self.schedule != "sequential":
            return 1
        m = self.clients_per_round
        return num_clients if m is None else min(m, num_clients)

    @staticmethod
    def _check_damping(rho: Any, start: int, num_rounds: int, per_round: int,
                       first_round: int) -> None:
        """A callable damping in (0, 1] at the server's counters ``start, start + 1, ...`` of
        ``num_rounds`` rounds (``per_round`` counters each, the first being round
        ``first_round + 1``), or a ``ValueError`` naming the first round that leaves it."""
        if not callable(rho):
            return
        counters = jnp.arange(start, start + num_rounds * per_round)
        values = np.asarray(jax.vmap(rho)(counters), dtype=float).reshape(-1)
        bad = np.nonzero(~((values > 0) & (values <= 1)))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"damping must be in (0, 1] at every round: the schedule gives "
                             f"{values[i]:.6g} at round {first_round + 1 + i // per_round} "
                             f"(the server's counter {start + i})")

    # -- running -------------------------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, factors: g.Gaussian | None = None, *,
             resume: PVIResult | None = None, runtime: Any = None,
             **model_kwargs: Any) -> RunState:
        """As :meth:`fedppl.PVI.init`: the tilted solver, the initial sites (``factors`` or
        ``resume``'s, else flat) and the clients' private guides."""
        return super().init(rng_key, clients, runtime=runtime, factors=factors, resume=resume,
                            **model_kwargs)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, *,
            progress_bar: bool = True, factors: g.Gaussian | None = None,
            tol: float | None = None, resume: PVIResult | None = None, runtime: Any = None,
            **model_kwargs: Any) -> EPResult:
        """As :meth:`fedppl.PVI.run`; a damping function is checked at every round first."""
        if callable(self.ep_damping) and isinstance(clients, Clients):
            rounds = num_rounds if isinstance(num_rounds, int) and num_rounds > 0 else 0
            self._check_damping(self.ep_damping, 0, rounds,
                                self._updates_per_round(clients.num_clients), 0)
        num_rounds = check_rounds(num_rounds)
        stop = kl_tol_rule(check_tol(tol, self.name, self.tol_objective is not None))
        state = self.init(rng_key, clients, factors, resume=resume, runtime=runtime,
                          **model_kwargs)
        return cast(EPResult, self._loop(state, num_rounds, progress_bar, stop))

    def update(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        """One round, its damping checked before it is applied."""
        rho = self._started(state).static.rho
        if callable(rho):
            per_round = self._updates_per_round(int(state.masks.shape[0]))
            self._check_damping(rho, int(state.server.round), 1, per_round, state.round)
        return super().update(state)


def prior_share(guide: PVIGuide, num_clients: int) -> _Share | None:
    """Each client's share of the prior's correction (None for a Gaussian prior)."""
    if guide.prior_correction is None:
        return None
    return _Share(solvers.PriorCorrection(guide), 1 / num_clients)


def ep_static(method: Any, guide: PVIGuide, model: Callable, solver: Any, clients: Clients, *,
            rho: Any = None, one_shot: str | None = None) -> Static:
    """PVI's static part for a run with a tilted solver (its ELBO, if any, by draws)."""
    S = method.elbo_samples
    elbo = shared(elbo_fn, solver, model, None, guide, S) if S > 0 else None
    return Static(guide, model, elbo, np.asarray(clients.sizes), None, None,
                  method.shrink_warning, rho=rho, one_shot=one_shot)


def _ep_trio(solver: ep.TiltedSolver, damping: Any, estimator: str, K: int | None,
             guide: PVIGuide, alpha: float, schedule: str, max_divergence: float
             ) -> tuple[Trio, Any]:
    """EP's trio and its damping (a number or a function of the round), made once per
    settings and guide through :func:`fedppl.infer.base.shared` (its round compiles once)."""
    rho = (damping if not isinstance(damping, str) else
           ep.decaying_damping(0.5, 0.1, 0.9) if estimator == "stein" else
           ep.decaying_damping(0.5, min(1.0 / cast(int, K), 0.2), 0.8))  # ep-stan's, K clients
    return ep.make_trio(solver, rho, guide.prior_or_raise(), alpha=alpha, schedule=schedule,
                        max_divergence=max_divergence), rho


def ep_record(before: RunState, after: RunState, msgs: Any, steps: Array, active: np.ndarray,
            rng_key: Array) -> tuple[Any, dict[str, Any]]:
    """PVI's history row with EP's columns."""
    log, row = record(before, after, msgs, steps, active, rng_key)
    for name in ("rhat", "ess", "mc_error", "extensions"):
        row[name] = np.where(active, np.asarray(getattr(msgs, name), float), np.nan)
    delta = [np.abs(np.asarray(x)).reshape(len(active), -1).max(axis=1)
             for x in (msgs.delta.nat1, msgs.delta.prec)]
    row["site_change"] = np.where(active, np.maximum(*delta), np.nan)
    assert after.plan is not None  # a started run's state
    rho = after.plan.static.rho
    row["damping"] = float(rho(jnp.asarray(before.server.round)) if callable(rho) else rho)
    return log, row


def ep_result(state: RunState, history: dict[str, np.ndarray],
            rejected: list[tuple[int, str, str]]) -> EPResult:
    res = result(state, history, rejected)
    return EPResult(**{f.name: getattr(res, f.name) for f in fields(res)})
