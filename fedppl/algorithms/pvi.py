"""Partitioned variational inference as pure functions (Ashman et al. 2022; Sec. 3 of the
federated sparse GP paper).

The server holds ``q = p * prod_k t_k``; client ``k`` holds its factor ``t_k`` (and, for a model
with local sites, a private guide over them: :class:`ClientState`). For a prior that is not
Gaussian in the unconstrained space, ``p`` is a Gaussian base times one more factor ``t_0`` that
the server holds and refines with :func:`prior_update`, a client step whose likelihood is the
prior's correction. One client step:

1. cavity ``q_{\\k} = q / t_k`` (repaired if not positive definite, and flagged);
2. ``q_k = argmax_q E_q[log p(y_k | theta)] - KL(q || q_{\\k})`` by a :class:`LocalSolver`
   (by default :class:`NaturalGradientSolver`, which solves it to a tolerance and says whether it
   did; the message carries that flag and the iteration count);
3. new factor ``t_k' = (q_k / q_{\\k})^rho * t_k^(1 - rho)`` (damping ``rho``);
4. the message is ``delta_k = t_k' / t_k``: the only thing that leaves the client.

The server judges each delta on its own against the current ``q`` (:func:`verdicts`) and refuses
it, recording why, if it is not finite, if ``q * delta_k`` is not positive definite, or if it is
implausible: a Jeffreys divergence between ``q`` and ``q * delta_k`` above ``max_divergence``
nats per dimension (default ``1e8``: a change no client's data can carry, such as precisions
multiplied by a million million). It multiplies the rest into ``q`` with the largest step in
1, 1/2, ..., 2^-10 that keeps ``q`` finite and positive definite (and, given a ``score``, does
not lower the global ELBO). The reply to each client is that step, or a refusal code
(:data:`REFUSALS`); the client applies its delta with the step it was given, so
``q = p * prod_k t_k`` holds exactly on both sides.

Example (one synchronous round by hand, as :class:`fedppl.PVI` runs it through the runtime;
Bayesian linear regression, so the local step is in closed form)::

    >>> import jax, jax.numpy as jnp, numpy as np, fedppl
    >>> from fedppl.families import gaussian as g
    >>> from fedppl.models import linear_regression
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> guide = fedppl.PVIGuide(linear_regression)
    >>> guide = guide.setup(*clients.client(0))
    >>> flat = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), g.zeros_like(guide.prior))
    >>> state, cstates = init(guide.prior, flat), ClientState(flat)
    >>> msgs, proposed = jax.vmap(client_update, (None, 0, 0, 0, 0, None, None))(
    ...     state.q, cstates, clients.stacked, clients.mask, jax.random.split(jax.random.key(0), 3),
    ...     ConjugateSolver(linear_regression, guide), 1.0)
    >>> state, steps = server_update(state, msgs)
    >>> cstates = acknowledge(cstates, msgs, steps, proposed)
    >>> steps.tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import optax
from jax import Array

from fedppl import trees
from fedppl.algorithms import conjugate
from fedppl.algorithms.natural_gradient import (
    LocalResult,
    NaturalGradientSolver,
    PriorSolver,
    log_lik_fn,
)
from fedppl.algorithms.trio import Trio
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.optimise import minimise

__all__ = [
    "ServerState", "ClientState", "ClientMessage", "prior_update", "LocalSolver", "LocalResult",
    "NaturalGradientSolver", "VariationalSolver", "ConjugateSolver",
    "init", "client_update", "server_update", "acknowledge", "make_trio", "verdicts", "REFUSALS",
    "was_scored", "LINE_SEARCHES",
]

STEP_SIZES = tuple(2.0**-i for i in range(11))
# the server's line search: never, in every synchronous round, or in the rounds it flags
LINE_SEARCHES = (False, True, "adaptive")
MAX_DIVERGENCE = 1e8

# The server's reply is the step a client's delta was applied with (> 0), or 0 / a negative code
# saying why it was not: what a front records as the reason.
NOT_FINITE, NOT_PD, IMPLAUSIBLE, NOT_RECEIVED = -1.0, -2.0, -3.0, -4.0
REFUSALS = {
    0.0: "not applied: the combined update left q not positive definite or lowered the ELBO "
         "at every step",
    NOT_FINITE: "message not finite",
    NOT_PD: "q would not be positive definite with this message",
    IMPLAUSIBLE: "implausible message: it changes q by more than max_divergence nats per "
                 "dimension (Jeffreys divergence)",
    NOT_RECEIVED: "no message arrived (the client dropped out of the round)",
}
# Under secure aggregation (fedppl.algorithms.secure_pvi) a client judges its own delta as the
# server would, and withholds it from the masked sum: its reply is OWN_CHECK plus the verdict
# (BEYOND_NORM: a delta beyond the public norm bound, changed after the client clipped it).
OWN_CHECK, BEYOND_NORM, SUM_HALTED, TOTAL_BEYOND = -10.0, -5.0, -6.0, -7.0
# DP-PVI's distributed noise: a secure total that carries less noise than the accounting assumes
NOISE_SHORT = -8.0
REFUSALS[SUM_HALTED] = ("secure aggregation halted: fewer clients answered than its threshold, "
                        "so no sum")
REFUSALS[TOTAL_BEYOND] = ("the secure total's norm exceeds the norm bound times the clients in "
                          "it (a client did not clip): refused for every client in the sum")
REFUSALS[NOISE_SHORT] = ("the secure total carries less noise than the privacy accounting "
                         "assumes (fewer clients in it than DPVirtualParties' distributed=): "
                         "refused for every client in the sum")
REFUSALS.update({OWN_CHECK + code: f"refused at the client before secure aggregation: {why}"
                 for code, why in ((NOT_FINITE, "message not finite"),
                                   (NOT_PD, "q would not be positive definite with it"),
                                   (IMPLAUSIBLE, "implausible message (max_divergence)"),
                                   (BEYOND_NORM, "beyond the secure sum's norm bound"))})


class ServerState(NamedTuple):
    """The server's ``q = p~ t_0 prod_k t_k``, the round, the prior factor ``t_0`` (None when
    the prior is Gaussian in the unconstrained space, so ``p~`` is the prior itself) and how
    far the last update moved q (``KL(q_new || q_old)``, infinite before the first: what the
    adaptive line search compares the next full step with)."""

    q: g.Gaussian
    round: Array
    prior_factor: g.Gaussian | None = None
    moved: Array | None = None


class ClientState(NamedTuple):
    """What client ``k`` keeps between rounds: its factor ``t_k`` and, for a model with local
    sites, its private guide over them (never sent); with DP-PVI's virtual parties
    (:class:`fedppl.DPVirtualParties`), their factors, whose sum is ``t_k`` (never sent)."""

    factor: g.Gaussian
    local: g.Conditional | None = None
    parties: g.Gaussian | None = None


class ClientMessage(NamedTuple):
    """What client k sends up: its factor update and diagnostics (no data)."""

    delta: g.Gaussian
    free_energy: Array
    cavity_repaired: Array
    converged: Array
    iterations: Array


class LocalSolver(Protocol):
    """Maximises client k's local free energy: ``(cavity, q, data, mask, key) -> LocalResult``.

    :class:`NaturalGradientSolver` (the default), :class:`ConjugateSolver`,
    :class:`VariationalSolver` and the Polya-Gamma solver implement it.
    """

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                 rng_key: Array) -> LocalResult: ...


class _LocalSitesSolver(Protocol):
    """A :class:`LocalSolver` that also takes a client's private guide over its local sites
    (:class:`NaturalGradientSolver`)."""

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                 rng_key: Array, local: g.Conditional | None = None) -> LocalResult: ...


class _PartiesSolver(Protocol):
    """A :class:`LocalSolver` that also takes a client's virtual parties' factors
    (:class:`~fedppl.algorithms.dp_mechanisms.VirtualPartiesSolver`)."""

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                 rng_key: Array, parties: g.Gaussian) -> LocalResult: ...

    def message(self, msg: ClientMessage) -> Any:
        """The message as it leaves the client (a message stating its noise, where the noise
        is distributed over a secure sum)."""


class VariationalSolver(NamedTuple):
    """Constant-step stochastic optimisation of the local free energy with an optax optimiser.

    Starts from the current ``q`` and runs ``steps`` updates of the guide's parameters (mean and
    scale) under ``lax.scan``, each with ``num_particles`` fresh reparametrised draws for the
    expected log-likelihood; the KL to the cavity is in closed form. Its optimiser noise stays in
    the factor, so PVI with it does not reach global VI's answer exactly
    (``benchmarks/pvi_accuracy.py``); kept for comparison and for models whose Hessian is too
    costly. ``converged`` reports whether ``KL(q_T || q_{0.9T}) <= tol`` over the last tenth of
    the steps.
    """

    model: Callable
    guide: PVIGuide
    optimizer: optax.GradientTransformation
    steps: int
    num_particles: int = 8
    tol: float = 1e-4
    # ``gradient(loss, q_cavity, data, mask) -> value_and_grad`` replaces the loss's exact
    # gradient with a private one (:class:`fedppl.algorithms.dp_mechanisms.DPSGD`); its solve then
    # reports no data-dependent diagnostics (free energy NaN, converged True)
    gradient: Callable | None = None

    def __call__(self, q_cavity, q, data, mask, rng_key):
        # (phi, seed=0) -> log p: the seed is left at its default here
        log_lik: Callable[..., Array] = log_lik_fn(self.model, self.guide, data, mask)
        guide, S = self.guide, self.num_particles
        cav_mean, _ = g.to_moments(q_cavity)

        def loss(params, key):
            mean, tril = guide.mean_and_tril(params)
            eps = jax.random.normal(key, (S, mean.shape[-1]), dtype=mean.dtype)
            theta = mean + (eps * tril if guide.diag else eps @ tril.T)
            ell = jnp.mean(jax.vmap(log_lik)(theta))
            return g.kl_from_moments(mean, tril, q_cavity, cav_mean) - ell

        keys = jax.random.split(rng_key, self.steps + 1)
        head = self.steps - max(self.steps // 10, 1)
        vg = None if self.gradient is None else self.gradient(loss, q_cavity, data, mask)
        params, _, opt_state = minimise(loss, guide.params_from(q), self.optimizer,
                                        keys=keys[1:head + 1], value_and_grad=vg)
        mid = guide.q_from(params)
        params = minimise(loss, params, self.optimizer, keys=keys[head + 1:],
                          opt_state=opt_state, value_and_grad=vg).params
        q_new = guide.q_from(params)
        if vg is not None:  # a private solve releases q_new and nothing else
            nan = jnp.full((), jnp.nan, q_new.nat1.dtype)
            return LocalResult(q_new, nan, jnp.asarray(True), jnp.asarray(self.steps))
        change = g.kl(q_new, mid)
        return LocalResult(q_new, -loss(params, keys[0]), change <= self.tol,
                           jnp.asarray(self.steps))


class ConjugateSolver(NamedTuple):
    """Closed-form maximiser for a Gaussian likelihood affine in the global sites."""

    model: Callable
    guide: PVIGuide

    def __call__(self, q_cavity, q, data, mask, rng_key):
        layout = self.guide.layout
        assert layout is not None  # the guide is set up before its solver runs
        lik = conjugate.likelihood_terms(client(self.model, mask=mask), layout, *data)
        cav_full = g.to_full(q_cavity)
        # a product of full-rank factors is full rank
        target = cast(g.FullGaussian, g.product(cav_full, conjugate.likelihood_factor(lik)))
        q_new = g.project_diag(target) if self.guide.diag else target
        free_energy = self.expected_log_lik(q_new, data, mask) - g.kl(q_new, q_cavity)
        return LocalResult(q_new, free_energy, jnp.asarray(True), jnp.asarray(1))

    def expected_log_lik(self, q: g.Gaussian, data: tuple, mask: Array) -> Array:
        """The client's ``E_q[log p(y_k | theta)]`` in closed form."""
        layout = self.guide.layout
        assert layout is not None  # the guide is set up before its solver runs
        lik = conjugate.likelihood_terms(client(self.model, mask=mask), layout, *data)
        mean, cov = g.to_moments(g.to_full(q))
        return conjugate.expected_log_lik(lik, mean, cov)


# -- the trio ------------------------------------------------------------------------------------


def init(prior: g.Gaussian, factors: g.Gaussian, prior_factor: g.Gaussian | None = None
         ) -> ServerState:
    """Server state for ``q = prior * prior_factor * prod_k factors[k]`` (factors stacked on
    axis 0)."""
    total = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), factors)
    q = g.product(prior, total) if prior_factor is None else g.product(prior, prior_factor, total)
    return ServerState(q, jnp.asarray(0), prior_factor, jnp.asarray(jnp.inf, q.nat1.dtype))


def client_update(q: g.Gaussian, state: ClientState, data: tuple, mask: Array, rng_key: Array,
                  solver: LocalSolver, damping: float | Array
                  ) -> tuple[ClientMessage, ClientState]:
    """One PVI step on one client; returns the message and the client's proposed new state."""
    q_cav, repaired = g.repair(g.quotient(q, state.factor))
    if state.parties is not None:  # DP-PVI's virtual parties refine their own factors
        solve = cast(_PartiesSolver, solver)
        msg, new = _propose(state, q_cav, repaired,
                            solve(q_cav, q, data, mask, rng_key, parties=state.parties), damping)
        return solve.message(msg), new
    if state.local is None:
        out = solver(q_cav, q, data, mask, rng_key)
    else:  # a client with local sites runs a solver that takes its private guide
        out = cast(_LocalSitesSolver, solver)(q_cav, q, data, mask, rng_key, local=state.local)
    return _propose(state, q_cav, repaired, out, damping)


def prior_update(state: ServerState, solver: PriorSolver, damping: float | Array, rng_key: Array
                 ) -> tuple[ClientMessage, ClientState]:
    """The server's step on its prior factor ``t_0``: a client step whose likelihood is the prior
    correction (no data, no mask)."""
    cstate = ClientState(_prior_factor(state))
    q_cav, repaired = g.repair(g.quotient(state.q, cstate.factor))
    return _propose(cstate, q_cav, repaired, solver(q_cav, state.q, (), None, rng_key), damping)


def _propose(state: ClientState, q_cav: g.Gaussian, repaired: Array, out: LocalResult,
             damping: float | Array) -> tuple[ClientMessage, ClientState]:
    """The damped new factor from a local solve, and the message that carries its change."""
    new_factor = g.damp(state.factor, g.quotient(out.q, q_cav), damping)
    msg = ClientMessage(g.quotient(new_factor, state.factor), out.free_energy, repaired,
                        out.converged, out.iterations)
    parties = None
    if state.parties is not None and out.parties is not None:  # damped like the factor
        parties = g.damp(state.parties, out.parties, damping)
    return msg, ClientState(new_factor, out.local, parties)


def _prior_factor(state: ServerState) -> g.Gaussian:
    if state.prior_factor is None:
        raise ValueError("the server state has no prior factor t_0: pass prior_factor to init")
    return state.prior_factor


def verdicts(q: g.Gaussian, deltas: g.Gaussian, max_divergence: float = MAX_DIVERGENCE
             ) -> Array:
    """Each delta (stacked on axis 0) judged alone against ``q``: 1.0 where acceptable, else the
    refusal code (:data:`REFUSALS`): not finite, ``q * delta`` not positive definite, or a
    Jeffreys divergence ``KL(q' || q) + KL(q || q')`` between ``q`` and ``q' = q * delta`` above
    ``max_divergence`` nats per dimension.

    A client's honest delta always passes the first two (undamped, ``q * delta_k`` is its local
    optimum ``q_k``; damped, a convex combination of ``q`` and ``q_k`` in natural parameters), so
    these refuse only broken or hostile messages; the divergence bound refuses finite messages too
    large for any data set to carry.
    """
    finite = g.is_finite(deltas)
    safe = jax.tree_util.tree_map(
        lambda d: jnp.where(finite.reshape(finite.shape + (1,) * (d.ndim - 1)), d, 0.0), deltas)
    moved = jax.vmap(lambda d: g.product(q, d))(safe)
    pd = g.is_pd(moved) & g.is_finite(moved)
    # the divergence only where q' is a proper Gaussian (q stands in elsewhere: 0)
    proper = jax.tree_util.tree_map(
        lambda m, b: jnp.where(pd.reshape(pd.shape + (1,) * (m.ndim - 1)), m, b[None]), moved, q)
    jeffreys = jax.vmap(lambda m: g.kl(m, q) + g.kl(q, m))(proper) / q.nat1.shape[-1]
    plausible = jeffreys <= max_divergence  # False for NaN (overflow): refused too
    return jnp.where(~finite, NOT_FINITE,
                     jnp.where(~pd, NOT_PD, jnp.where(~plausible, IMPLAUSIBLE, 1.0)))


def server_update(state: ServerState, messages: ClientMessage, received: Array | None = None,
                  score: Callable[[g.Gaussian], tuple[Array, Array]] | None = None,
                  max_divergence: float = MAX_DIVERGENCE, adaptive: bool = False,
                  keep: float = 0.0) -> tuple[ServerState, Array]:
    """Apply the acceptable deltas (stacked on axis 0; :func:`verdicts`) with the largest step in
    1, 1/2, ..., 2^-10 that keeps q finite and positive definite and, if ``score`` is given, does
    not lower the global ELBO by more than ``1e-2 + 1e-6 |ELBO|`` nats (a line search along the
    combined update; the slack absorbs the Monte Carlo mismatch between a solver's fixed point
    and its ELBO estimate).

    ``score(q)`` returns the clients' expected log-likelihoods under ``q`` (one per client) and
    ``KL(q || prior)``; the ELBO sums every client whose expected log-likelihood is finite and
    whose delta is acceptable, so a client with bad data cannot stall the others. Clients that sat
    the round out still count (in the embedded runtime their data are at hand; a deployment
    would stand in their factors for them).
    ``adaptive`` calls ``score`` (in a deployment, one more exchange) only in a round whose full
    step the data alone cannot vouch for: q would not be positive definite with it, or it would
    move q further (``KL(q_new || q)``) than the last update did (the symptom of synchronous
    clients over-counting each other); other rounds take the largest positive-definite step.
    ``received`` (booleans, one per message) marks the clients that replied this round; the
    others' slots are ignored. Returns the new state (with how far q moved) and each client's
    reply: the step its delta was applied with, or 0 or a negative refusal code
    (:data:`REFUSALS`) if it was not applied. ``keep`` > 0 (DP-PVI's distributed noise, whose
    clients do not halve their noisy steps): the step must also leave at least ``keep`` times
    q's precision in every direction (a total's noise could otherwise take a precision near
    zero, and the mean with it), and a delta that alone would leave q improper is not refused
    but left to that step search, as a client would halve its own.
    """
    verdict = verdicts(state.q, messages.delta, max_divergence)
    if keep > 0:  # a noisy delta that alone would leave q improper: the step search judges it
        verdict = jnp.where(verdict == NOT_PD, 1.0, verdict)
    ok = verdict > 0
    if received is not None:
        ok = ok & received
        verdict = jnp.where(received, verdict, NOT_RECEIVED)
    clean = jax.tree_util.tree_map(
        lambda d: jnp.where(ok.reshape(ok.shape + (1,) * (d.ndim - 1)), d, 0.0), messages.delta
    )
    total = jax.tree_util.tree_map(lambda d: jnp.sum(d, axis=0), clean)
    sizes = jnp.asarray(STEP_SIZES, dtype=total.nat1.dtype)
    candidates = jax.vmap(lambda s: g.product(state.q, g.scale(total, s)))(sizes)
    accept = g.is_pd(candidates) & g.is_finite(candidates)
    if keep > 0:
        accept = accept & g.is_pd(jax.vmap(lambda c: g.product(c, g.scale(state.q, -keep)))(
            candidates))
    if score is not None:
        judge = partial(_no_drop, score, state.q, candidates, verdict != NOT_FINITE)
        if adaptive:
            flagged = _flagged(state.q, state.moved, trees.first(candidates))
            judged = jax.lax.cond(flagged, judge, lambda: jnp.ones(sizes.shape, bool))
        else:
            judged = judge()
        accept = accept & judged
    step = jnp.where(jnp.any(accept), sizes[jnp.argmax(accept)], 0.0)
    q = g.product(state.q, g.scale(total, step))
    replies = jnp.where(ok, step, jnp.minimum(verdict, 0.0))
    return state._replace(q=q, round=state.round + 1, moved=g.kl(q, state.q)), replies


def _flagged(q: g.Gaussian, moved: Array | None, full: g.Gaussian) -> Array:
    """The adaptive line search's check, from the server's own numbers: the full step to
    ``full`` leaves q not positive definite, or moves it further than the last update moved it
    (``moved``; None: no update yet)."""
    last = jnp.inf if moved is None else moved
    proper = g.is_pd(full) & g.is_finite(full)
    return ~proper | ~(g.kl(full, q) <= last)  # a NaN divergence is flagged too


@jax.jit
def was_scored(q_old: g.Gaussian, moved: Array, q_new: g.Gaussian, step: Array) -> Array:
    """Whether the adaptive line search scored a round (one more exchange in a deployment)
    that took the server's ``q_old`` (its last update having moved it by ``moved``) to
    ``q_new`` with ``step`` (the clients' largest reply: the step taken, 0 where every step was
    refused though some updates were acceptable, negative where none was), its full step
    recovered from the two. For the history; the server decides by :func:`server_update`."""
    full = jax.tree_util.tree_map(lambda a, b: a + (b - a) / jnp.where(step > 0, step, 1.0),
                                  q_old, q_new)
    return jnp.where(step > 0, _flagged(q_old, moved, full), step == 0)


def _no_drop(score: Callable[[g.Gaussian], tuple[Array, Array]], q: g.Gaussian,
             candidates: g.Gaussian, usable: Array) -> Array:
    """Which candidates (stacked on axis 0) do not lower the global ELBO of ``q`` by more than
    the line search's slack (the current q and every candidate scored in one batch: one
    exchange in a deployment); ``usable`` marks the clients whose scores count."""
    both = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a[None], b]), q, candidates)
    ells, kls = jax.vmap(score)(both)
    use = usable & jnp.isfinite(ells[0])

    def elbo(ell, kl):
        return jnp.sum(jnp.where(use, ell, 0.0), axis=-1) - kl

    current = elbo(ells[0], kls[0])
    floor = current - 1e-2 - 1e-6 * jnp.abs(current)
    return elbo(ells[1:], kls[1:]) >= floor


def acknowledge(states: ClientState, messages: ClientMessage, steps: Array,
                proposed: ClientState | None = None) -> ClientState:
    """Clients apply their delta with the step the server accepted (stacked on axis 0); a client
    whose update was applied (step > 0) keeps its ``proposed`` private guide, the others their
    old one."""

    def apply(t, d):
        s = steps.reshape(steps.shape + (1,) * (d.ndim - 1))
        return t + jnp.where(s > 0, s * d, 0.0)

    factor = jax.tree_util.tree_map(apply, states.factor, messages.delta)
    local, parties = states.local, states.parties
    if local is not None and proposed is not None:
        local = jax.tree_util.tree_map(
            lambda new, old: jnp.where(steps.reshape(steps.shape + (1,) * (new.ndim - 1)) > 0,
                                       new, old), proposed.local, local)
    if parties is not None and proposed is not None and proposed.parties is not None:
        # the parties' factors move by the same step, so they still sum to the factor
        parties = jax.tree_util.tree_map(lambda old, new: apply(old, new - old), parties,
                                         proposed.parties)
    return ClientState(factor, local, parties)


def make_trio(solver: LocalSolver, damping: float, prior: g.Gaussian, *,
              prior_solver: PriorSolver | None = None, line_search: bool | str = False,
              schedule: str = "synchronous", max_divergence: float = MAX_DIVERGENCE) -> Trio:
    """PVI as a :class:`~fedppl.algorithms.trio.Trio` on (:class:`ServerState`,
    :class:`ClientState`, :class:`ClientMessage`); the reply to a client is the step its delta
    was applied with.

    ``line_search`` (for a solver with ``expected_log_lik``) makes the server of a synchronous
    round score candidate ``q`` on every client's data (the runtime's ``evaluate``) against
    ``KL(q || prior)``: in every round (True), or only in the rounds the data-free check of
    :func:`server_update` flags (``"adaptive"``). ``prior_solver`` (a prior that is not
    Gaussian) makes the server refine its prior factor ``t_0`` every round: first in a
    ``"sequential"`` round, alongside the clients (one more message, inside the line search) in
    the others.
    """

    keep = float(getattr(solver, "keep_precision", 0.0))

    def client(server: ServerState, cstate: ClientState, data, mask, rng_key, index):
        return client_update(server.q, cstate, data, mask, rng_key, solver, damping)

    def score_with(evaluate):
        if evaluate is None:
            return None

        def score(q):
            ell = evaluate(q)
            if prior_solver is not None:
                ell = jnp.concatenate([ell, prior_solver.expected_log_lik(q)[None]])
            return ell, g.kl(q, prior)

        return score

    if line_search not in LINE_SEARCHES:
        raise ValueError(f"line_search must be one of {LINE_SEARCHES}, got {line_search!r}")
    adaptive = line_search == "adaptive"

    def server(state: ServerState, msgs: ClientMessage, index, received, rng_key, evaluate):
        score = score_with(evaluate)
        if prior_solver is None or schedule == "sequential":
            return server_update(state, msgs, received, score, max_divergence, adaptive, keep)
        pmsg, _ = prior_update(state, prior_solver, damping, rng_key)
        both = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b[None]]), msgs, pmsg)
        state, steps = server_update(state, both, jnp.append(received, True), score,
                                     max_divergence, adaptive, keep)
        return _acknowledge_prior(state, pmsg, steps[-1]), steps[:-1]

    def begin(state: ServerState, rng_key):
        assert prior_solver is not None  # begin runs only with a prior solver
        pmsg, _ = prior_update(state, prior_solver, damping, rng_key)
        new, s = server_update(state, trees.one(pmsg), jnp.ones(1, bool), None, max_divergence)
        return _acknowledge_prior(state._replace(q=new.q), pmsg, s[0])

    def ack(cstate: ClientState, msg: ClientMessage, step, proposed: ClientState):
        return trees.first(acknowledge(trees.one(cstate), trees.one(msg), step[None],
                                       trees.one(proposed)))

    evaluate = None
    if line_search and hasattr(solver, "expected_log_lik"):

        def evaluate(q, cstate: ClientState, data, mask):
            if cstate.local is None:
                return solver.expected_log_lik(q, data, mask)
            return solver.expected_log_lik(q, data, mask, cstate.local)

    sequential_prior = prior_solver is not None and schedule == "sequential"
    return Trio(client, server, ack, evaluate, begin if sequential_prior else None)


def _acknowledge_prior(state: ServerState, msg: ClientMessage, step: Array) -> ServerState:
    """The server applies its own prior-factor delta with the step it accepted."""
    t0 = acknowledge(trees.one(ClientState(_prior_factor(state))), trees.one(msg), step[None])
    return state._replace(prior_factor=trees.first(t0).factor)


