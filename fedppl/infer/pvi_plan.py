"""The plan pieces PVI, GlobalVI, EP and OneShot share: the guide's set-up (with the clients'
checks of :mod:`fedppl.infer.client_checks`), the initial states, how a round's messages become
a history row (``record``) and the final state a result (``result``), what a message costs on
the wire, the trio and the global ELBO (made once per settings through
:func:`fedppl.infer.base.shared`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import trees
from fedppl.algorithms import conjugate, natural_gradient, polya_gamma, pvi, solvers
from fedppl.algorithms.natural_gradient import PriorSolver
from fedppl.algorithms.trio import Trio
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.infer.base import RunState, StopRule
from fedppl.infer.client_checks import check_clients, hint_local_sites
from fedppl.infer.pvi_result import PVIResult
from fedppl.infer.round_log import RoundRecord, report, unfinished

__all__ = ["SOLVERS", "Static", "Log", "start_log", "set_up", "flat_factors",
           "initial_states", "record", "result", "kl_tol_rule", "pvi_trio", "elbo_fn",
           "message_bytes", "broadcast_bytes", "refused", "check_line_search", "line_search_for"]

SOLVERS = ("natural-gradient", "optax")


def check_line_search(line_search: Any, privacy: Any = None) -> bool | str | None:
    """``line_search=`` as given to a PVI front (None, False, True or ``"adaptive"``), refused
    with ``privacy`` unless off."""
    if isinstance(line_search, (bool, np.bool_)):
        line_search = bool(line_search)
    elif not (line_search is None or line_search == "adaptive"):
        raise ValueError(f"line_search must be None (the runtime's default), True, False or "
                         f"'adaptive', got {line_search!r}")
    if privacy is not None and line_search:
        raise ValueError("line_search scores candidate q on the clients' data, which a "
                         "private run does not release: leave it off with privacy=")
    return line_search


def line_search_for(line_search: bool | str | None, privacy: Any, data_at_server: bool
                    ) -> bool | str:
    """The line search a run uses (the method's setting is left as it is): the setting where
    given; by default off for a private run, every round where the runtime's server holds the
    data (the embedded runtime: scoring sends no message), and ``"adaptive"`` on a deployment
    (Flower: a second exchange only in the rounds the server's check flags)."""
    if line_search is not None:
        return line_search
    if privacy is not None:
        return False
    return True if data_at_server else "adaptive"


def message_bytes(msgs: Any) -> int:
    """Bytes of one client's factor update (messages stacked on the client axis), from shapes
    (indexing one client out compiled a program per shape)."""
    return g.num_bytes(jax.eval_shape(trees.first, msgs.delta))


def broadcast_bytes(server: pvi.ServerState) -> int:
    """Bytes of what the server sends each client: q."""
    return g.num_bytes(server.q)


def refused(replies: Array, active: np.ndarray) -> np.ndarray:
    """The clients whose update the server did not accept (a step of 0 or a refusal code)."""
    return np.asarray(replies) <= 0



class Static(NamedTuple):
    """The static part of a Gaussian-q plan (``plan.static``): the guide as set up for the run
    (a copy that later set-ups of the method's guide leave alone), the model as run (static
    keyword arguments bound), the compiled global ELBO (None: none), the clients' sizes, a
    private run's calibration and settings, the shrink warning's factor, EP's damping (a number
    or a function of the server's round), a one-shot's method (``"consensus"``: the server
    merges the clients' draws) and the line search the run uses (:func:`line_search_for`)."""

    guide: PVIGuide
    model: Callable
    elbo: Callable | None
    sizes: np.ndarray
    calibration: solvers.Calibration | None
    privacy: Any
    shrink_warning: float
    rho: Any = None
    one_shot: str | None = None
    line_search: bool | str = False


class Log(NamedTuple):
    """A Gaussian-q run's accumulators (``state.log.method``): the round log's record, the
    rounds each client took part in (privacy accounting) and a consensus one-shot's merged
    draws."""

    rounds: RoundRecord
    dp_rounds: np.ndarray
    merged: Array | None = None


def start_log(num_clients: int) -> Log:
    return Log(RoundRecord(), np.zeros(num_clients, int))


def set_up(guide: PVIGuide, clients: Clients, model_kwargs: dict,
           polya_gamma_model: Callable | None = None) -> PVIGuide:
    """``guide`` set up on client 0's data, the clients checked against the model (every
    observation in its support, local sites of one shape), and a copy of the guide that the
    run keeps (later set-ups of ``guide`` on other shapes leave it alone). With
    ``polya_gamma_model``, Polya-Gamma's own checks come first (their errors say more)."""
    guide.setup(*clients.client(0), **model_kwargs)
    if polya_gamma_model is not None and guide.local_layout is None:
        polya_gamma.validate(polya_gamma_model, guide, clients)
    check_clients(guide, clients, model_kwargs)
    hint_local_sites(guide, clients, model_kwargs)
    return copy.copy(guide)


def flat_factors(prior: g.Gaussian, num_clients: int) -> g.Gaussian:
    """Flat factors ``t_k = 1`` for ``num_clients`` clients, stacked."""
    zero = g.zeros_like(prior)
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_clients, *x.shape)), zero)


def initial_states(guide: PVIGuide, K: int, factors: g.Gaussian | None,
                   resume: PVIResult | None, prior_factor: bool
                   ) -> tuple[pvi.ServerState, pvi.ClientState]:
    """The server's and the clients' first states: the factors (``factors`` or ``resume``'s,
    checked against the model's shapes, else flat), the server's prior factor (``resume``'s, or
    flat) where ``prior_factor``, and the clients' private guides."""
    prior = guide.prior_or_raise()
    if resume is not None:
        factors = resume.factors
    want = flat_factors(prior, K)
    factors = want if factors is None else g.strong(factors)
    if jax.tree_util.tree_map(jnp.shape, factors) != jax.tree_util.tree_map(jnp.shape, want):
        raise ValueError(
            "the factors to resume from do not fit this model and these clients: shapes "
            f"{jax.tree_util.tree_map(jnp.shape, factors)}, expected "
            f"{jax.tree_util.tree_map(jnp.shape, want)} (a different number of clients or "
            "of features?)")
    t0 = None
    if prior_factor:
        t0 = (resume.prior_factor if resume is not None and resume.prior_factor is not None
              else g.zeros_like(prior))
    local = guide.init_local()
    if local is not None:
        local = (resume.local if resume is not None and resume.local is not None else
                 jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), local))
    return pvi.init(prior, factors, t0), pvi.ClientState(factors, local)


def record(before: RunState, after: RunState, msgs: Any, steps: Array, active: np.ndarray,
           rng_key: Array) -> tuple[Log, dict[str, Any]]:
    """A round's history columns (``free_energy``, ``converged``, ``local_iterations``,
    ``step``, ``kl_change``, ``exchanges``, ``elbo``, a private run's ``epsilon``) and the
    accumulators after it (the round log warns here, naming the clients).

    ``exchanges`` counts the server's exchanges with its clients in the round, as a deployment
    makes them (the embedded runtime makes none): one for a synchronous round, two where the
    line search scored it; one per client taking part in a sequential round."""
    plan = after.plan
    assert plan is not None  # a started run's state
    st, log = plan.static, after.log.method
    q_old, q_new = before.server.q, after.server.q
    steps = np.asarray(steps)
    rounds = report(log.rounds, plan.names, st.shrink_warning, after.round - 1, steps, msgs,
                    active, q_old, q_new)
    row = {"free_energy": np.where(active, np.asarray(msgs.free_energy), np.nan),
           "converged": np.where(active, np.asarray(msgs.converged, float), np.nan),
           "local_iterations": np.where(active, np.asarray(msgs.iterations, float), np.nan),
           "step": np.where(active, np.maximum(np.asarray(steps, float), 0.0), np.nan),
           "kl_change": float(_kl_change(q_new, q_old)),
           "exchanges": _exchanges(plan, before.server, after.server, steps, active)}
    row["elbo"] = np.nan
    dp_rounds = log.dp_rounds
    if st.privacy is not None:
        dp_rounds = dp_rounds + np.asarray(active, bool)
        row["epsilon"] = _epsilon(st, dp_rounds)
    elif st.elbo is not None and plan.data_at_server:
        row["elbo"] = float(st.elbo(after.server, after.clients, after.data, after.masks,
                                    rng_key))
    return log._replace(rounds=rounds, dp_rounds=dp_rounds), row


def _exchanges(plan: Any, old: pvi.ServerState, new: pvi.ServerState, steps: np.ndarray,
               active: np.ndarray) -> int:
    """The server's exchanges with its clients in a round, as a deployment makes them."""
    if plan.schedule == "sequential":
        return int(np.sum(active))
    mode = plan.static.line_search if plan.trio.client_evaluate is not None else False
    if mode == "adaptive":
        return 1 + bool(pvi.was_scored(old.q, old.moved, new.q, np.max(steps)))
    return 1 + bool(mode)


def result(state: RunState, history: dict[str, np.ndarray],
           rejected: list[tuple[int, str, str]]) -> PVIResult:
    """The result of a run that ended in ``state`` (the refusals are the round log's)."""
    plan = state.plan
    assert plan is not None  # a started run's state
    st, log = plan.static, state.log.method
    if "rhat" not in history:  # EP's unconverged samplers were named in their rounds
        unfinished(history, plan.names)
    held = prototype = None
    local = state.clients.local if plan.data_at_server else None  # else the clients' own
    if local is not None and getattr(st.guide, "log_lik_fn", None) is None:
        held = _held(st.model, st.guide, state.data, state.masks)
        prototype = tuple(x[0] for x in state.data)
    return PVIResult(guide=st.guide, q=state.server.q, factors=state.clients.factor,
                     history=history, rejected=list(log.rounds.rejected),
                     client_names=plan.names, unconverged=list(log.rounds.unconverged),
                     local=local, held=held, prototype=prototype,
                     prior_factor=state.server.prior_factor, model=st.model,
                     privacy=_privacy_report(st, log, plan.names))


def _held(model: Callable, guide: PVIGuide, data: tuple, masks: Array) -> Array:
    """``(K, d)``: the local coordinates each client's data touch."""
    one = jax.vmap(lambda d, m: natural_gradient.held_coordinates(model, guide, d, m))
    return jax.jit(one)(data, masks)



def kl_tol_rule(tol: float | None) -> StopRule | None:
    """``run(..., tol=)``: stop once q moves by ``KL(q_new || q_old) <= tol`` in a round."""
    if tol is None:
        return None

    def rule(rows: list[dict[str, Any]]) -> str | None:
        kl = float(rows[-1]["kl_change"])
        return f"kl_change {kl:.3g} <= tol {tol:g}" if kl <= tol else None

    return rule


def _epsilon(st: Static, dp_rounds: np.ndarray) -> np.ndarray:
    assert st.privacy is not None and st.calibration is not None
    return st.privacy.spent(st.calibration.sigma, dp_rounds, st.sizes, st.calibration.steps)


def _privacy_report(st: Static, log: Log, names: tuple[str, ...]) -> dict[str, Any] | None:
    if st.privacy is None:
        return None
    assert st.calibration is not None  # calibrated with the solver
    eps = _epsilon(st, log.dp_rounds)
    report = {"epsilon": dict(zip(names, eps.tolist(), strict=True)),
              "worst_epsilon": float(eps.max()), "delta": st.privacy.delta,
              "noise_multiplier": st.calibration.sigma, "clip": st.privacy.clip}
    distributed = getattr(st.privacy, "distributed", None)
    if distributed is not None:  # the guarantee of one message alone (the totals': above)
        sigma = st.privacy.message_multiplier(st.calibration.sigma)
        alone = st.privacy.spent(sigma, log.dp_rounds, st.sizes, st.calibration.steps)
        report.update(distributed=distributed, message_noise_multiplier=sigma,
                      message_epsilon=dict(zip(names, alone.tolist(), strict=True)),
                      worst_message_epsilon=float(alone.max()))
    return report


# -- compiled once per (model, guide, settings) ----------------------------------------------


def pvi_trio(solver: pvi.LocalSolver, damping: float, guide: PVIGuide,
              prior_solver: PriorSolver | None, line_search: bool, schedule: str,
              max_divergence: float) -> Trio:
    """PVI's trio (made once per settings and guide through :func:`fedppl.infer.base.shared`,
    so one round, compiled once: see :func:`fedppl.infer.base.embedded_round`)."""
    return pvi.make_trio(solver, damping, guide.prior_or_raise(), prior_solver=prior_solver,
                         line_search=line_search, schedule=schedule,
                         max_divergence=max_divergence)


def elbo_fn(solver: pvi.LocalSolver, model: Callable, prior_solver: PriorSolver | None,
             guide: PVIGuide, S: int) -> Callable:
    """Jitted global ELBO ``sum_k E_q[log p(y_k, z_k | theta)] + H[q(z_k | theta)] +
    E_q[prior correction] - KL(q || p~)`` with ``S`` fresh draws (in closed form for a
    conjugate model); made once per solver, model and guide through
    :func:`fedppl.infer.base.shared`."""
    prior = guide.prior_or_raise()

    if isinstance(solver, pvi.ConjugateSolver):

        def per_client(q, data_k, mask_k, local_k, key):
            lik = conjugate.likelihood_terms(client(model, mask=mask_k), guide.layout, *data_k)
            mean, cov = g.to_moments(g.to_full(q))
            return conjugate.expected_log_lik(lik, mean, cov)

    else:

        def per_client(q, data_k, mask_k, local_k, key):
            log_lik = natural_gradient.log_lik_fn(model, guide, data_k, mask_k)
            joint = q if local_k is None else g.join(q, local_k, guide.client_diag)
            phi = g.sample(key, joint, S)
            ll = jnp.mean(jax.vmap(log_lik)(phi, jnp.arange(S)))
            return ll if local_k is None else ll + g.conditional_entropy(local_k)

    @jax.jit
    def elbo(state, clients, data, masks, key):
        q = state.q
        keys = jax.random.split(key, masks.shape[0])
        ell = jax.vmap(per_client, in_axes=(None, 0, 0, 0, 0))(q, data, masks, clients.local,
                                                               keys)
        total = jnp.sum(ell) - g.kl(q, prior)
        if prior_solver is not None:
            theta = g.sample(jax.random.fold_in(key, 1), q, S)
            total = total + jnp.mean(jax.vmap(prior_solver.correction)(theta))
        return total

    return elbo


@jax.jit
def _kl_change(q_new: g.Gaussian, q_old: g.Gaussian) -> Array:
    return g.kl(q_new, q_old)

