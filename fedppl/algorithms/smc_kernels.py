"""The federated SMC sampler's server-side kernels (:mod:`fedppl.algorithms.smc` makes the
trio): pure, jit-able functions of the particles and the sums of the clients' numbers.

* tempering: :func:`island_ess`, :func:`next_temperature` (bisection: blackjax's
  ``smc.solver.dichotomy``) and :func:`resample` (blackjax's systematic resampling, within each
  island);
* proposals: :func:`fit` (the particles' mean and covariance factor), :func:`propose` (a walk:
  one leapfrog step with a partly refreshed momentum or a Crank-Nicolson step around the fit,
  or a scale mixture of Gaussians fitted to the particles), the walk's gradient :func:`kick`,
  its end :func:`walk_end` and the Crank-Nicolson step's ratio :func:`crank_nicolson_ratio`, the
  mixture's density :func:`log_independent`, and the pooled independence steps
  :func:`pool_moves`.

Example (the server's pieces: the next temperature keeps half of each island's effective
particles, and resampling stays within the islands; :mod:`fedppl.infer.smc` builds the trio
from a model)::

    >>> import jax, jax.numpy as jnp
    >>> log_lik = 10 * jax.random.normal(jax.random.key(0), (100,))
    >>> beta = next_temperature(jnp.asarray(0.0), log_lik, islands=4, ess_target=0.5)
    >>> bool(0 < beta < 1), round(float(island_ess(beta * log_lik, 4)), 3)
    (True, 0.5)
    >>> ancestors = resample(jax.random.key(1), beta * log_lik, islands=4)
    >>> bool(jnp.all(ancestors[:25] < 25)), bool(jnp.all(ancestors[25:50] // 25 == 1))
    (True, True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array
from jax.scipy.special import logsumexp

__all__ = ["island_ess", "scaled", "next_temperature", "resample", "fit", "propose", "kick",
           "walk_end", "crank_nicolson_ratio", "carried_accept", "log_independent", "pool_moves"]


def island_ess(log_weights: Array, islands: int) -> Array:
    """The mean over islands of each island's ESS as a share of its particles."""
    lw = log_weights.reshape(islands, -1)
    n = lw.shape[1]
    log_ess = 2 * logsumexp(lw, axis=1) - logsumexp(2 * lw, axis=1)
    return jnp.mean(jnp.exp(log_ess)) / n


def scaled(delta: Array, log_lik: Array) -> Array:
    """``delta * log_lik`` with ``-inf`` (a particle the data rule out) kept at ``-inf``."""
    return jnp.where(jnp.isneginf(log_lik), -jnp.inf, delta * jnp.nan_to_num(log_lik))


def next_temperature(beta: Array, log_lik: Array, islands: int, ess_target: float) -> Array:
    """The next temperature: the largest ``b' <= 1`` whose incremental weights
    ``(b' - b) * log_lik`` keep an island ESS of ``ess_target`` (bisection, blackjax's
    ``dichotomy``); 1 if that keeps it already."""
    from blackjax.smc.solver import dichotomy

    def excess(delta):
        return island_ess(scaled(delta, log_lik), islands) - ess_target

    top = 1.0 - beta
    delta = dichotomy(excess, jnp.zeros_like(top), top, eps=1e-6)
    delta = jnp.where(jnp.isnan(delta), 1e-6 * top, delta)  # no step keeps it: the smallest
    return jnp.minimum(beta + jnp.clip(delta, 0.0, top), 1.0)


def resample(key: Array, log_weights: Array, islands: int) -> Array:
    """Ancestors ``(N,)``: systematic resampling (blackjax) within each island."""
    from blackjax.smc.resampling import systematic

    lw = log_weights.reshape(islands, -1)
    n = lw.shape[1]
    w = jnp.exp(lw - logsumexp(lw, axis=1, keepdims=True))
    idx = jax.vmap(systematic, (0, 0, None))(jax.random.split(key, islands), w, n)
    return (idx + n * jnp.arange(islands)[:, None]).reshape(-1).astype(jnp.int32)


def fit(theta: Array) -> tuple[Array, Array]:
    """Mean and Cholesky factor of the particles' covariance (with a relative jitter)."""
    D = theta.shape[1]
    centre = jnp.mean(theta, 0)
    cov = jnp.cov(theta.T).reshape(D, D)
    jitter = 1e-9 * jnp.maximum(jnp.trace(cov) / D, jnp.finfo(theta.dtype).tiny)
    return centre, jnp.linalg.cholesky(cov + (jitter + 1e-12) * jnp.eye(D, dtype=theta.dtype))


def propose(key: Array, theta: Array, centre: Array, chol: Array, rw_scale: Array,
            scales: tuple[float, ...], independent: float, momentum: Array,
            persistence: Array | float = 0.0, kick_from: Array | None = None,
            crank_nicolson: bool = False) -> tuple[Array, Array, Array]:
    """Proposals ``(N, D)``, their kinds ``(N,)`` and the walk's momenta ``(N, D)``.

    With probability ``independent`` an independence draw (kind ``j + 1``: component ``j`` of
    the scale mixture, covariance ``scales[j] chol chol'`` around ``centre``), else a walk
    (kind 0): the particle's whitened momentum is partly refreshed, ``u = a momentum +
    sqrt(1 - a^2) xi`` for ``a = persistence`` and a standard normal ``xi`` (0: a fresh draw),
    and one leapfrog step from ``theta`` in the coordinates that ``chol`` whitens, of length
    ``h = rw_scale``: ``theta + h chol (u + kick_from)`` for the half step's kick
    (:func:`kick`; none: a plain random walk). The refreshed ``u`` is returned for every
    particle (:func:`walk_end` completes the step and gives its ratio). With
    ``crank_nicolson`` the walk is instead a preconditioned Crank-Nicolson step around the fit,
    ``centre + r (theta - centre) + s chol xi`` with ``s = min(rw_scale, 1)`` and
    ``r = sqrt(1 - s^2)``: reversible for ``N(centre, chol chol')``, so its ratio
    (:func:`crank_nicolson_ratio`) is the target's over that Gaussian's, and where the target is
    near Gaussian a long step is still accepted (``s = 1``: an independence draw)."""
    k_kind, k_comp, k_eps = jax.random.split(key, 3)
    N = theta.shape[0]
    xi = jax.random.normal(k_eps, theta.shape, theta.dtype)
    comp = jax.random.randint(k_comp, (N,), 0, len(scales))
    jumps = jax.random.uniform(k_kind, (N,)) < independent
    a = jnp.asarray(persistence, theta.dtype)
    u = a * momentum + jnp.sqrt(1 - a**2) * xi
    if crank_nicolson:
        s = jnp.minimum(rw_scale, 1.0)
        walk = centre + jnp.sqrt(1 - s**2) * (theta - centre) + s * (xi @ chol.T)
    else:
        walk = theta + rw_scale * ((u + (0.0 if kick_from is None else kick_from)) @ chol.T)
    jump = centre + jnp.sqrt(jnp.asarray(scales, theta.dtype)[comp])[:, None] * (xi @ chol.T)
    return (jnp.where(jumps[:, None], jump, walk),
            jnp.where(jumps, comp + 1, 0).astype(jnp.int32), u)


def kick(grad: Array, chol: Array, rw_scale: Array) -> Array:
    """A leapfrog half step's change to the whitened momenta, ``(h / 2) chol' grad`` ``(N, D)``,
    for the tempered target's gradient ``grad`` ``(N, D)`` (in the coordinates ``chol``
    whitens, the gradient is ``chol' grad``; the step's length is ``h = rw_scale``). With a
    fresh momentum, one leapfrog step is a Metropolis-adjusted Langevin step
    ``N(theta + (h^2 / 2) C grad, h^2 C)``, ``C = chol chol'``.

    >>> import jax.numpy as jnp
    >>> kick(jnp.asarray([[1.0, -2.0]]), jnp.diag(jnp.asarray([2.0, 1.0])), 0.5).tolist()
    [[0.5, -0.5]]
    """
    return 0.5 * rw_scale * grad @ chol


def walk_end(momentum: Array, kick_from: Array, kick_to: Array) -> tuple[Array, Array]:
    """The leapfrog step's end: the momenta at the proposals, ``u + kick_from + kick_to``, and
    the log of the step's Metropolis-Hastings factor beside the target's ratio, the kinetic
    energy's fall ``(|u|^2 - |u'|^2) / 2`` (the step with its momentum flipped is its own
    inverse and keeps volume, so nothing else enters; without kicks it is 0: a random walk).
    A rejected particle keeps its place with its momentum flipped (generalised Hamiltonian
    Monte Carlo: Horowitz, 1991), so with ``persistence`` near 1 an accepted particle keeps
    going the way it went."""
    u_new = momentum + kick_from + kick_to
    return u_new, 0.5 * (jnp.sum(momentum**2, -1) - jnp.sum(u_new**2, -1))


def crank_nicolson_ratio(theta: Array, proposal: Array, centre: Array, chol: Array) -> Array:
    """The log of a Crank-Nicolson step's Metropolis-Hastings factor beside the target's ratio:
    ``log N(theta) - log N(proposal)`` for the Gaussian ``N(centre, chol chol')`` the step is
    reversible for, ``(|w'|^2 - |w|^2) / 2`` in the coordinates ``chol`` whitens.

    >>> import jax.numpy as jnp
    >>> crank_nicolson_ratio(jnp.asarray([[1.0, 0.0]]), jnp.asarray([[0.0, 4.0]]),
    ...                      jnp.zeros(2), 2 * jnp.eye(2)).tolist()
    [1.875]
    """
    return 0.5 * (_whitened_r2(proposal, centre, chol) - _whitened_r2(theta, centre, chol))


def _whitened_r2(x: Array, centre: Array, chol: Array) -> Array:
    """``|chol^-1 (x - centre)|^2`` for each row of ``x``."""
    u = jax.scipy.linalg.solve_triangular(chol, (x - centre).T, lower=True)
    return jnp.sum(u**2, 0)


def carried_accept(log_ratio: Array, lift: Array, step: float) -> tuple[Array, Array]:
    """Metropolis-Hastings decisions with a uniform that each particle carries instead of
    drawing (Neal, 2020): ``lift`` ``(N,)`` in ``[-1, 1)`` moves by ``step`` (wrapped), the move
    is accepted where ``|lift| < exp(log_ratio)``, and an accepted particle's ``lift`` is divided
    by that ratio. ``|lift|`` stays uniform whatever the particle (the pair is the particle with
    a height under its density), so the target stays invariant. With a small ``step`` the
    rejections come in runs, and a persistent walk turns back less often: two rejections in a
    row turn it back twice. Returns the decisions and the new ``lift``.

    >>> import jax.numpy as jnp
    >>> ok, lift = carried_accept(jnp.log(jnp.asarray([0.5, 0.5])), jnp.asarray([0.1, 0.6]),
    ...                           0.2)
    >>> ok.tolist(), [round(v, 6) for v in lift.tolist()]
    ([True, False], [0.6, 0.8])
    """
    lift = lift + step
    lift = jnp.where(lift >= 1, lift - 2, lift)
    ok = jnp.log(jnp.abs(lift)) < log_ratio
    return ok, jnp.where(ok, lift * jnp.exp(-jnp.where(ok, log_ratio, 0.0)), lift)


def log_independent(x: Array, centre: Array, chol: Array, scales: tuple[float, ...]) -> Array:
    """Log density at each row of ``x`` of the independence proposals' scale mixture (equal
    weights on ``N(centre, c chol chol')`` for each ``c`` in ``scales``)."""
    D = x.shape[1]
    r2 = _whitened_r2(x, centre, chol)
    base = -jnp.sum(jnp.log(jnp.diagonal(chol))) - 0.5 * D * jnp.log(2 * jnp.pi)
    parts = [base - 0.5 * r2 / c - 0.5 * D * jnp.log(c) for c in scales]
    return logsumexp(jnp.stack(parts), axis=0) - jnp.log(len(scales))


def pool_moves(key: Array, weight: Array, pool: Array, usable: Array, islands: int,
               steps: int) -> Array:
    """Independence Metropolis-Hastings steps over a shared pool, each particle on its own.

    ``weight`` ``(N,)``: each particle's log target over the independence proposals' density
    at its position; ``pool`` ``(N,)``: the same at each proposal; ``usable``: the proposals
    drawn independently of their particle. In step ``t`` the particle at place ``j`` of its
    island (``n`` particles) is offered proposal ``(j + o_t) mod n`` of the same island, the
    offsets ``o_t`` distinct and never 0, and moves there with probability
    ``min(1, exp(pool - weight))``. A particle thus meets only proposals drawn independently of
    it and of each other, each once: every step is an independence sampler's step, and the
    target stays invariant for each particle. Particles of one island may move to the same
    proposal (the islands stay independent: their spread is still the Monte Carlo error).
    Returns, per particle, the proposal it moved to last (-1: none).

    >>> import jax.numpy as jnp
    >>> pick = pool_moves(jax.random.key(0), jnp.zeros(4), jnp.asarray([9., 9., 9., 9.]),
    ...                      jnp.asarray([True, False, True, False]), islands=2, steps=1)
    >>> pick.tolist()  # each particle offered its island's other proposal; 1 and 3 are walks
    [-1, 0, -1, 2]
    """
    N = weight.shape[0]
    n = N // islands
    steps = min(steps, n - 1)
    if steps <= 0:
        return jnp.full(N, -1, jnp.int32)
    k_off, k_u = jax.random.split(key)
    offsets = (1 + jax.random.permutation(k_off, n - 1)[:steps]).astype(jnp.int32)
    log_u = jnp.log(jax.random.uniform(k_u, (steps, N), weight.dtype))
    place = jnp.arange(N, dtype=jnp.int32)
    first = place - place % n

    def step(carry, xs):
        w, pick = carry
        offset, lu = xs
        c = first + (place % n + offset) % n
        ok = usable[c] & (lu < jnp.nan_to_num(pool[c] - w, nan=-jnp.inf))
        return (jnp.where(ok, pool[c], w), jnp.where(ok, c, pick)), None

    (_, pick), _ = jax.lax.scan(step, (weight, jnp.full(N, -1, jnp.int32)), (offsets, log_u))
    return pick
