"""Federated tempered SMC: the pooled posterior of a NumPyro model, sampled by particles whose
global sites live at the server and whose local sites never leave their client.

The target is ``pi(theta) ∝ p(theta) prod_k p(y_k | theta)`` over the flat unconstrained vector
``theta`` of the global sites (a :class:`~fedppl.guides.PVIGuide`'s layout). ``N`` particles
start from a reference ``q0`` (a federated answer's Gaussian) and the likelihood is brought in by
tempering, ``pi_b ∝ q0^(1 - b) pi^b`` for ``b`` from 0 to 1 (Del Moral, Doucet and Jasra, 2006).
Each round, in one exchange:

* the server sends the particles ``theta``, a proposal ``theta'`` for each (and which were
  drawn independently of their particle), the ancestors of the last resampling and the
  temperature (:class:`Broadcast`: nothing else leaves the server);
* each client sends back, per particle, its log-likelihood at ``theta`` and at ``theta'``
  (:class:`Message`: ``2 N`` numbers, never a record, never a local site);
* the server accepts or rejects each move by Metropolis-Hastings from the sums over clients
  (its own prior and ``q0`` terms added), and tells the clients where each particle is now (its
  old place or a proposal's); once enough particles have moved at this temperature,
  it picks the next one so that the effective sample size of the incremental weights
  ``(b' - b) * log-likelihood`` stays near ``ess_target * N`` (reusing numbers already sent: no
  extra round), resamples within each island (systematic), and draws the next proposals.

The clients' log-likelihoods with local sites ``z_k`` (random effects) are pseudo-marginal: each
client integrates its own ``z_k`` by an importance estimate unbiased for ``p(y_k | theta)``
(Laplace proposal, ``local_draws`` normal draws in antithetic pairs:
:func:`fedppl.algorithms.importance.laplace_estimate`). Those normal draws are auxiliary
variables of the particle, kept at the client (as a key): a move of ``theta`` reuses them, so
the estimates at ``theta`` and ``theta'`` are correlated and their ratio is far less noisy than
either; between moves the client refreshes them by a Metropolis-Hastings step of its own
(target ``p_hat^b`` times their normal density: no exchange). The extended target's marginal in
``theta`` at ``b = 1`` is the pooled posterior exactly (Andrieu and Roberts, 2009); the
tempered intermediate ones are ``q0^(1-b) p^b E[p_hat^b]``, near ``pi_b`` while the estimates'
variance is small.

The moves: with probability ``independent`` an independence proposal from a scale mixture of
Gaussians fitted to the particles (mean and covariance, times each of ``scales``: the wider
components let a cloud that started too narrow grow), else a random walk with the particles'
covariance, its scale tuned towards ``rw_target`` acceptance; each is accepted by its own
Metropolis-Hastings ratio (the mixture's density enters the independence one), so each move
leaves the tempered target invariant. A client estimates an independence proposal with fresh
auxiliary draws (a random walk keeps the particle's), so the proposal with its estimate is a
draw independent of every particle: after its own move, each particle takes ``pool_steps``
further independence steps over the other independence proposals of its island
(:func:`pool_moves`). Those cost the clients nothing: they evaluated every proposal already.
The walk is one leapfrog step of Hamiltonian Monte Carlo (preconditioned by the particles'
covariance) with a momentum the server keeps for each particle: ``persistence`` of it is kept
from round to round, a rejected particle turns back (generalised HMC: Horowitz, 1991), so with
``persistence`` near 1 the walk travels over many rounds as one trajectory would, at one
exchange a round; with 0 it is a random walk, or with ``gradient`` a Metropolis-adjusted
Langevin step. With ``gradient`` the step is kicked by the tempered target's gradient
(:func:`kick`): the clients send their log-likelihood's gradient at each proposal too, where
there are local sites the gradient of the Laplace approximation of their marginal
(:func:`~fedppl.algorithms.importance.laplace_gradient`), so the kick is a function of the
particle (and its Laplace fit) alone and the refreshes of the auxiliary draws leave the step's
ratio exact (a leapfrog step with any force that depends on the position alone keeps volume
and is reversed by flipping the momentum).
With ``crank_nicolson`` the walk is instead a preconditioned Crank-Nicolson step around the
particles' Gaussian fit (Cotter, Roberts, Stuart and White, 2013): it leaves that Gaussian
invariant, so its ratio is the target's over the Gaussian's, and its step can stay long where
the target is near the fit.

``islands``: the particles are split into equal islands that are resampled separately (the
temperature and the proposals are shared), so the spread of the islands' means gives an honest
Monte Carlo error for any moment (Vergé, Dubarry, Del Moral and Moulines, 2015).

The server's kernels (tempering, resampling, proposals and their densities) are pure functions
in :mod:`fedppl.algorithms.smc_kernels`; this module makes the trio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from fedppl.algorithms.importance import laplace_estimate, laplace_fit, laplace_gradient
from fedppl.algorithms.smc_kernels import (
    carried_accept,
    crank_nicolson_ratio,
    fit,
    island_ess,
    kick,
    log_independent,
    next_temperature,
    pool_moves,
    propose,
    resample,
    scaled,
    walk_end,
)
from fedppl.algorithms.trio import Trio
from fedppl.families import gaussian as g

__all__ = ["Settings", "Broadcast", "ServerState", "ClientState", "Pending", "Message", "Reply",
           "server_init", "client_init", "make_trio"]


#: nats: a client's log-likelihood beyond this in size is refused (no data set gives one)
LIMIT = 1e9


class Settings(NamedTuple):
    """The sampler's static settings (hashable: one compiled round per settings).

    ``num_particles`` (a multiple of ``islands``); ``local_draws`` (even; 0 without local
    sites); ``newton_steps`` of each local Laplace fit; ``refreshes`` of a client's auxiliary
    draws per round; ``ess_target`` (the share of particles the incremental weights keep);
    ``renew`` (the share of particles that must have moved at a temperature before the next);
    ``independent`` (the share of independence proposals), ``scales`` (their covariance
    multipliers), ``rw_target`` (the random walk's acceptance), ``batch_size`` (particles a
    client evaluates at once), ``pool_steps`` (each particle's further independence steps per
    round over its island's independence proposals: :func:`pool_moves`; 0: none),
    ``gradient`` (the walk is kicked by the tempered target's gradient, preconditioned by the
    particles' covariance; the clients send their log-likelihood's gradient at each proposal:
    :func:`kick`), ``persistence`` (the share of the walk's momentum kept from one round to
    the next: 0, a fresh momentum each round; near 1, particles keep going the way they went:
    :func:`propose`), ``uniform_step`` (each particle carries the uniform of its acceptance
    decisions and moves it by this much a round, so that rejections come in runs:
    :func:`carried_accept`; 0: a fresh uniform each round), ``crank_nicolson`` (the walk is a
    preconditioned Crank-Nicolson step around the particles' Gaussian fit instead of a
    leapfrog step: :func:`propose`; no gradient, no persistence)."""

    num_particles: int = 1000
    islands: int = 10
    local_draws: int = 64
    newton_steps: int = 3
    refreshes: int = 1
    ess_target: float = 0.5
    renew: float = 0.5
    independent: float = 0.5
    scales: tuple[float, ...] = (1.0, 2.0, 4.0)
    rw_target: float = 0.3
    batch_size: int = 256
    pool_steps: int = 0
    gradient: bool = False
    persistence: float = 0.0
    uniform_step: float = 0.0
    crank_nicolson: bool = False


class Broadcast(NamedTuple):
    """What the server sends every client: the particles ``(N, D)``, a proposal for each
    ``(N, D)``, the ancestors of the last resampling ``(N,)`` (indices into the clients' own
    particles before it), the temperature, whether this is the first round (the clients set
    their particles up at ``theta`` and nothing moves), and which proposals were drawn
    independently of their particle ``(N,)`` (a client estimates those with fresh auxiliary
    draws, so that any particle of the island can move there)."""

    theta: Array
    proposal: Array
    ancestors: Array
    beta: Array
    start: Array
    fresh: Array


class ServerState(NamedTuple):
    """The server's state: what it broadcasts (the first five fields) and what stays with it:
    the summed log-likelihood of the clients at each particle ``log_lik`` ``(N,)``, which
    particles moved at this temperature, the random walk's scale, the proposal mixture's mean
    and Cholesky factor and which kind made each proposal (for the acceptance ratio), the
    incremental log weights of the last reweighting (for its k-hat), the stage (temperatures
    so far), the moves at temperature 1, the last round's acceptance and ESS, the reference
    ``q0`` the particles started from, each client's last log-likelihoods ``(K, N)`` (what
    its next message is judged against), the clients' summed log-likelihood gradient at
    each particle ``(N, D)`` (``(N, 0)`` without gradient moves: :func:`kick`), and each
    particle's whitened momentum ``(N, D)``, as refreshed for its last proposal
    (:func:`propose`), and the uniform each carries for its decisions ``(N,)``
    (:func:`carried_accept`)."""

    theta: Array
    proposal: Array
    ancestors: Array
    beta: Array
    start: Array
    log_lik: Array
    moved: Array
    rw_scale: Array
    centre: Array
    chol: Array
    kind: Array
    increment: Array
    stage: Array
    final_moves: Array
    accepted: Array
    ess: Array
    reference: g.Gaussian
    client_log_lik: Array
    score: Array
    momentum: Array
    lift: Array


class Pending(NamedTuple):
    """What a client's last step proposed, the parts of which the server's reply selects: the
    keys and estimates after its refresh, and the keys, Laplace fits and estimates at the
    proposals."""

    keys: Array
    estimate: Array
    proposal_keys: Array
    mode: Array
    chol: Array
    moved: Array


class ClientState(NamedTuple):
    """A client's part of every particle: the key of its auxiliary normal draws ``(N, 2)``
    (key data), the Laplace fit of its local sites at the particle's ``theta`` (mode ``(N, d)``,
    precision's Cholesky factor ``(N, d, d)``), its current log-likelihood estimate ``(N,)``,
    its private guide's conditional mean map (``nat1``, ``prec``, ``cross`` of a
    :class:`~fedppl.families.gaussian.Conditional`, the Laplace fit's starting point; zeros
    without one), and what its last step proposed (:class:`Pending`). Without local sites
    only ``estimate`` is used. The state a step proposes has the particles as resampled (its
    refresh and its moves pending): :func:`make_trio`'s ``acknowledge`` applies the reply."""

    keys: Array
    mode: Array
    chol: Array
    estimate: Array
    guide: g.Conditional
    pending: Pending


class Message(NamedTuple):
    """A client's message: its log-likelihood (estimate) at each particle after its refresh
    ``(N,)`` and at each proposal ``(N,)``, the share of its refreshes accepted, and the median
    over the proposals of its log-estimates' estimated variance (0 without local sites: exact;
    a diagnostic of the estimates' noise, which slows the moves), and with gradient moves the
    gradient in ``theta`` of its log-likelihood at each proposal ``(N, D)`` (with local sites,
    the gradient of the Laplace approximation at the proposal's fit: a deterministic function
    of the proposal and its fit, whatever the particle's auxiliary draws; ``(N, 0)`` without)."""

    current: Array
    proposed: Array
    refreshed: Array
    variance: Array
    score: Array


class Reply(NamedTuple):
    """The server's reply: where each particle is now ``(N,)``, an index into the particles
    (``i``: it stayed) followed by the proposals (``N + j``: it moved to proposal ``j``, its
    own or, by :func:`pool_moves`, another of its island's); ``keep`` (False: the round was
    void, a client's message missing or refused; every client undoes its refresh);
    ``refused`` (this client's message was refused, or never came)."""

    source: Array
    keep: Array
    refused: Array


def server_init(key: Array, q0: g.Gaussian, num_clients: int, settings: Settings
                ) -> ServerState:
    """The first state: ``N`` particles drawn from ``q0``, no proposal yet (the first round
    sets the clients' particles up)."""
    theta = g.sample(key, q0, settings.num_particles)
    N, D = theta.shape
    zero = jnp.zeros((), theta.dtype)
    centre, chol = fit(theta)
    return ServerState(theta, theta, jnp.arange(N, dtype=jnp.int32), zero, jnp.asarray(True),
                       jnp.zeros(N, theta.dtype), jnp.zeros(N, bool),
                       jnp.asarray(2.38 / D**0.5, theta.dtype), centre, chol,
                       jnp.zeros(N, jnp.int32), jnp.zeros(N, theta.dtype),
                       jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), zero,
                       jnp.ones((), theta.dtype), q0,
                       jnp.zeros((num_clients, N), theta.dtype),
                       jnp.zeros((N, D if settings.gradient else 0), theta.dtype),
                       jnp.zeros((N, D), theta.dtype),
                       jax.random.uniform(jax.random.fold_in(key, 1), (N,), theta.dtype, -1, 1))


def client_init(num_particles: int, local_dim: int, guide: g.Conditional | None,
                global_dim: int, dtype: Any) -> ClientState:
    """A client's first state (its particles are set up in the first round)."""
    N, d, D = num_particles, local_dim, global_dim
    if guide is None:
        guide = g.Conditional(jnp.zeros(d, dtype), jnp.eye(d, dtype=dtype),
                              jnp.zeros((d, D), dtype))
    key_shape = jax.random.key_data(jax.random.key(0)).shape
    keys = jnp.zeros((N, *key_shape), jnp.uint32)
    mode, chol = jnp.zeros((N, d), dtype), jnp.broadcast_to(jnp.eye(d, dtype=dtype), (N, d, d))
    zero = jnp.zeros(N, dtype)
    return ClientState(keys, mode, chol, zero, guide, Pending(keys, zero, keys, mode, chol, zero))


# -- the trio ----------------------------------------------------------------------------------


def make_trio(log_lik: Callable, log_prior: Callable, local_dim: int, settings: Settings
              ) -> Trio:
    """The sampler as a trio.

    ``log_lik(data, mask) -> f(theta, z)``: a client's log density of its data and local sites
    (``z`` of length ``local_dim``, 0 without local sites); ``log_prior(theta)``: the prior's log
    density in the unconstrained space (the server's). The reference ``q0`` the particles start
    from is in the server's state (:func:`server_init`), so one trio serves every start."""
    d, M = local_dim, settings.local_draws

    def estimates(f, theta, keys, mode, chol):
        """Each particle's log-likelihood estimate with its own auxiliary draws, and the
        estimated variance of each (zero without local sites)."""
        if d == 0:
            est = _map(lambda th: f(th, jnp.zeros(0, th.dtype)), theta, settings.batch_size)
            return est, jnp.zeros_like(est)

        def one(args):
            th, k, m, c = args
            return laplace_estimate(lambda z: f(th, z), m, c, jax.random.wrap_key_data(k), M)

        return _map(one, (theta, keys, mode, chol), settings.batch_size)

    def scores(f, theta, mode):
        """Each particle's log-likelihood gradient in ``theta`` (with gradient moves): exact
        without local sites, else the gradient of the Laplace approximation of its marginal
        over the local sites at the particle's fitted mode (:func:`laplace_gradient`): a
        deterministic function of the particle and its fit, which the client's refreshes of
        the auxiliary draws leave alone, and without Monte Carlo noise."""
        if not settings.gradient:
            return jnp.zeros((theta.shape[0], 0), theta.dtype)
        if d == 0:
            return _map(jax.grad(lambda th: f(th, jnp.zeros(0, th.dtype))), theta,
                        settings.batch_size)

        return _map(lambda args: laplace_gradient(f, *args), (theta, mode), settings.batch_size)

    def fits(f, theta, guide, start):
        """Each particle's Laplace fit of its local sites at ``theta``, from the private guide's
        conditional mean (or ``start``, where it has none)."""
        if d == 0:
            return start, jnp.zeros((theta.shape[0], 0, 0), theta.dtype)

        def one(args):
            th, z0 = args
            mean = jnp.linalg.solve(guide.prec, guide.nat1 - guide.cross @ th)
            z0 = jnp.where(jnp.any(guide.cross != 0) | jnp.any(guide.nat1 != 0), mean, z0)
            return laplace_fit(lambda z: f(th, z), z0, settings.newton_steps)

        return _map(one, (theta, start), settings.batch_size)

    def set_up(bc: Broadcast, client: ClientState, f, key):
        N = bc.theta.shape[0]
        keys = jax.random.key_data(jax.random.split(key, N))
        mode, chol = fits(f, bc.theta, client.guide, client.mode)
        est, var = estimates(f, bc.theta, keys, mode, chol)
        pending = Pending(keys, est, keys, mode, chol, est)
        return (Message(est, est, jnp.ones((), est.dtype), jnp.median(var),
                        scores(f, bc.theta, mode)),
                ClientState(keys, mode, chol, est, client.guide, pending))

    def move(bc: Broadcast, client: ClientState, f, key):
        # the particles as the server resampled them (its guide and last proposal as they are)
        keys, mode, chol, est = (x[bc.ancestors] for x in client[:4])
        before = ClientState(keys, mode, chol, est, client.guide, client.pending)
        k_refresh, k_fresh = jax.random.split(key)
        rate = jnp.ones((), est.dtype)
        if d > 0 and settings.refreshes > 0:  # the auxiliary draws, refreshed at the client
            total = jnp.zeros((), est.dtype)
            for r in range(settings.refreshes):
                k_new, k_u = jax.random.split(jax.random.fold_in(k_refresh, r))
                fresh = jax.random.key_data(jax.random.split(k_new, keys.shape[0]))
                new_est = estimates(f, bc.theta, fresh, before.mode, before.chol)[0]
                u = jax.random.uniform(k_u, est.shape, est.dtype)
                ok = jnp.log(u) < scaled(bc.beta, new_est) - scaled(bc.beta, est)
                keys = jnp.where(ok[:, None], fresh, keys)
                est = jnp.where(ok, new_est, est)
                total = total + jnp.mean(ok)
            rate = total / settings.refreshes
        # a move to a proposal keeps the particle's draws (its estimate there is correlated
        # with the current one); one drawn independently of the particle gets fresh draws
        fresh = jax.random.key_data(jax.random.split(k_fresh, keys.shape[0]))
        proposal_keys = jnp.where(bc.fresh[:, None], fresh, keys)
        mode, chol = fits(f, bc.proposal, client.guide, before.mode)
        moved, var = estimates(f, bc.proposal, proposal_keys, mode, chol)
        return (Message(est, moved, rate, jnp.median(var), scores(f, bc.proposal, mode)),
                before._replace(pending=Pending(keys, est, proposal_keys, mode, chol, moved)))

    def client_update(bc: Broadcast, client: ClientState, data, mask, key, index):
        f = log_lik(data, mask)
        return jax.lax.cond(bc.start, lambda: set_up(bc, client, f, key),
                            lambda: move(bc, client, f, key))

    def acknowledge(client: ClientState, message: Message, reply: Reply,
                    proposed: ClientState) -> ClientState:
        p, N = proposed.pending, proposed.estimate.shape[0]
        moved, i = reply.source >= N, reply.source % N

        def pick(now, then):
            return jnp.where(moved.reshape(-1, *(1,) * (now.ndim - 1)), then[i], now[i])

        kept = proposed._replace(
            keys=pick(p.keys, p.proposal_keys), estimate=pick(p.estimate, p.moved),
            mode=pick(proposed.mode, p.mode), chol=pick(proposed.chol, p.chol))
        # a void round: the particles as resampled, the refresh undone
        return jax.tree_util.tree_map(lambda a, b: jnp.where(reply.keep, a, b), kept, proposed)

    def server_terms(q0, theta):
        """The server's own part of the log target, ``(log q0, log prior - log q0)``."""
        lq = jax.vmap(lambda th: g.log_prob(q0, th))(theta)
        return lq, jax.vmap(log_prior)(theta) - lq

    def target_grad(q0, theta, score, beta):
        """The tempered target's gradient at each particle, ``grad log q0 + beta (grad log
        prior - grad log q0 + score)`` for the clients' summed gradients ``score``."""
        glq = jax.vmap(jax.grad(lambda th: g.log_prob(q0, th)))(theta)
        return glq + beta * (jax.vmap(jax.grad(log_prior))(theta) - glq + score)

    def server_update(state: ServerState, msgs: Message, index, received, key, evaluate):
        K = received.shape[0]
        refused = received & ~plausible(state, msgs)
        ok = jnp.all(received) & ~jnp.any(refused)
        k_acc, k_temp, k_prop = jax.random.split(key, 3)
        current = jnp.sum(jnp.where(ok, msgs.current, 0.0), 0)
        proposed = jnp.sum(jnp.where(ok, msgs.proposed, 0.0), 0)
        lq, l0 = server_terms(state.reference, state.theta)
        lq_new, l0_new = server_terms(state.reference, state.proposal)
        cur = l0 + current
        new = l0_new + proposed
        target = lq + scaled(state.beta, cur)  # the tempered target's log density
        target_new = lq_new + scaled(state.beta, new)
        # the particle's own proposal: a walk (its ratio from the momenta), or an independence draw
        lg = log_independent(state.theta, state.centre, state.chol, settings.scales)
        lg_new = log_independent(state.proposal, state.centre, state.chol, settings.scales)
        fresh = state.kind > 0
        # the clients' summed gradients at the proposals (a row with a non-finite entry, as
        # at a proposal the data rule out, is taken as zero: the kick stays a function of
        # the proposal), and at the particles (their own, sent with them at the set-up)
        score_new = jnp.sum(jnp.where(ok, msgs.score, 0.0), 0)
        finite = jnp.all(jnp.isfinite(score_new), -1, keepdims=True)
        score_new = jnp.where(finite, score_new, 0.0)
        score = jnp.where(state.start, score_new, state.score)
        kicks = jnp.zeros((2, *state.theta.shape), state.theta.dtype)
        if settings.gradient:  # the leapfrog step's kicks, at the particle and the proposal
            kicks = jnp.stack([
                kick(target_grad(state.reference, x, s, state.beta), state.chol, state.rw_scale)
                for x, s in ((state.theta, score), (state.proposal, score_new))])
        momentum_new, walk_ratio = walk_end(state.momentum, *kicks)
        if settings.crank_nicolson:
            walk_ratio = crank_nicolson_ratio(state.theta, state.proposal, state.centre,
                                              state.chol)
        log_ratio = target_new - target + jnp.where(fresh, lg - lg_new, walk_ratio)
        k_acc, k_pool = jax.random.split(k_acc)
        log_ratio = jnp.nan_to_num(log_ratio, nan=-jnp.inf)
        lift = state.lift
        if settings.uniform_step > 0:  # each particle's carried uniform
            accepted, carried = carried_accept(log_ratio, lift, settings.uniform_step)
            lift = jnp.where(ok & ~state.start, carried, lift)
        else:
            accepted = jnp.log(jax.random.uniform(k_acc, log_ratio.shape,
                                                  log_ratio.dtype)) < log_ratio
        accepted = accepted & ok & ~state.start
        N = log_ratio.shape[0]
        place = jnp.arange(N, dtype=jnp.int32)
        source = jnp.where(accepted, N + place, place)
        # then further independence steps over the island's independence proposals
        pool = target_new - lg_new
        usable = fresh & jnp.isfinite(pool) & ok & ~state.start
        pick = pool_moves(k_pool, jnp.where(accepted, pool, target - lg), pool, usable,
                          settings.islands, settings.pool_steps)
        source = jnp.where(pick >= 0, N + pick, source)
        # a walk accepted goes on with the step's momentum, one rejected turns back
        walk = (state.kind == 0) & ~state.start
        momentum = jnp.where((walk & ok)[:, None],
                             jnp.where(accepted[:, None], momentum_new, -state.momentum),
                             state.momentum)
        theta = jnp.concatenate([state.theta, state.proposal])[source]
        log_lik = jnp.where(ok, jnp.concatenate([cur, new])[source], state.log_lik)
        score = jnp.where(ok, jnp.concatenate([score, score_new])[source], state.score)
        went = source != place
        moved = state.moved | went
        rate_walk = jnp.sum(accepted & walk) / jnp.maximum(jnp.sum(walk), 1)
        rw_scale = jnp.where(ok & jnp.any(walk),
                             state.rw_scale * jnp.exp(rate_walk - settings.rw_target),
                             state.rw_scale)
        if settings.crank_nicolson:  # its step is at most 1 (an independence draw)
            rw_scale = jnp.minimum(rw_scale, 1.0)
        # the next temperature, once enough particles moved at this one
        temper = ok & (state.beta < 1) & (state.start | (jnp.mean(moved) >= settings.renew))
        beta = jnp.where(temper, next_temperature(state.beta, log_lik, settings.islands,
                                                  settings.ess_target), state.beta)
        increment = scaled(beta - state.beta, log_lik)
        ancestors = jnp.where(temper, resample(k_temp, increment, settings.islands),
                              jnp.arange(theta.shape[0], dtype=jnp.int32))
        ess = jnp.where(temper, island_ess(increment, settings.islands), 1.0)
        theta, log_lik, score = theta[ancestors], log_lik[ancestors], score[ancestors]
        moved = jnp.where(temper, False, moved)
        centre, chol = fit(theta)
        first = None
        if settings.gradient:  # the leapfrog step's first kick
            first = kick(target_grad(state.reference, theta, score, beta), chol, rw_scale)
        # the momenta follow their particles; a resampled cloud starts afresh
        proposal, kind, momentum = propose(
            k_prop, theta, centre, chol, rw_scale, settings.scales, settings.independent,
            momentum[ancestors], jnp.where(temper, 0.0, settings.persistence), first,
            settings.crank_nicolson)
        lift = lift[ancestors]
        at_one = (state.beta >= 1) & ok
        own = jnp.concatenate([msgs.current, msgs.proposed], 1)[:, source[ancestors]]
        client_log_lik = jnp.where(ok, own, state.client_log_lik[:, ancestors])
        new_state = ServerState(
            theta, proposal, ancestors, beta, state.start & ~ok, log_lik, moved, rw_scale,
            centre, chol, kind, jnp.where(temper, increment, state.increment),
            state.stage + temper, state.final_moves + at_one,
            jnp.where(state.start, jnp.nan, jnp.mean(went)).astype(theta.dtype),
            ess.astype(theta.dtype), state.reference, client_log_lik, score, momentum, lift)
        replies = Reply(jnp.broadcast_to(source, (K, *source.shape)),
                        jnp.broadcast_to(ok, (K,)), refused | ~received)
        return new_state, replies

    def plausible(state: ServerState, msgs: Message) -> Array:
        """Which clients' messages the server can use ``(K,)``: no NaN, no ``+inf``, nothing
        beyond ``LIMIT`` nats (but a proposal's ``-inf`` or very low value, which the move
        rejects), and after the first round nothing far above what the client sent before: a
        current value within ``band`` of its last one (a refresh changes it by the estimate's
        noise), a proposal at most ``band`` above its largest, ``band`` the larger of 100 nats
        and ten times the spread of its last values; a variance in ``[0, LIMIT]``."""
        cur, new = msgs.current, msgs.proposed
        ok = ~(jnp.isnan(cur) | jnp.isnan(new) | jnp.isposinf(cur) | jnp.isposinf(new))
        ok &= (jnp.abs(jnp.where(jnp.isneginf(cur), 0.0, cur)) <= LIMIT) & (new <= LIMIT)
        last = state.client_log_lik  # in the order of the particles sent
        finite = jnp.where(jnp.isfinite(last), last, jnp.nan)
        top = jnp.nanmax(finite, axis=1, keepdims=True)
        band = jnp.maximum(100.0, 10.0 * (top - jnp.nanmin(finite, axis=1, keepdims=True)))
        near = (jnp.abs(cur - last) <= band) | ~jnp.isfinite(last)
        below = (new <= top + band) | jnp.isnan(top)
        ok &= state.start | (near & below)
        # a gradient: finite (but where the proposal's value is -inf) and within LIMIT
        sc = msgs.score
        ok &= jnp.all((jnp.isfinite(sc) | jnp.isneginf(new)[..., None])
                      & (jnp.abs(jnp.nan_to_num(sc)) <= LIMIT), axis=-1)
        var = msgs.variance  # a diagnostic, but a client that sends nonsense is refused whole
        return jnp.all(ok, axis=1) & (var >= 0) & (var <= LIMIT)

    def broadcast(state: ServerState) -> Broadcast:
        return Broadcast(state.theta, state.proposal, state.ancestors, state.beta, state.start,
                         state.kind > 0)

    return Trio(client_update, server_update, acknowledge, broadcast=broadcast)


def _map(fn: Callable, xs: Any, batch_size: int) -> Any:
    """``jax.lax.map`` over the particles in batches of ``batch_size``."""
    n = jax.tree_util.tree_leaves(xs)[0].shape[0]
    return jax.lax.map(fn, xs, batch_size=min(batch_size, n))
