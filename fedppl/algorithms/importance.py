"""Importance sampling against the pooled posterior: the federated check and its refinement.

The target is the posterior the pooled data would give over the flat unconstrained vector
``theta`` of a model's global sites,

    log pi(theta) = log p(theta) + sum_k l_k(theta) + const,

where ``p`` is the exact prior (the guide's Gaussian base times ``exp`` of its correction, see
:func:`fedppl.sites.prior_correction`) and ``l_k`` is client ``k``'s log-likelihood. With local
sites (a client's random effects ``z_k``) ``l_k(theta) = log int p(y_k, z_k | theta) dz_k``, which
the client estimates at each ``theta`` by Laplace-importance sampling
(:func:`laplace_log_marginal`). The server draws ``theta_s`` from a proposal, each client returns
``l_k(theta_s)`` for every draw (``S`` numbers, never a record), and the server forms
``log w_s = log pi(theta_s) - log g(theta_s)``; Pareto-smoothed importance sampling (arviz-stats'
PSIS) turns them into the diagnostic ``k-hat``, an effective sample size, and corrected
moments. Every piece here is a pure function; :mod:`fedppl.infer.importance` is the front.

Proposals are multivariate Student t's (``df = inf``: a Gaussian). Over several rounds the
draws of all proposals so far are weighted by their deterministic mixture (adaptive multiple
importance sampling, AMIS: Cornuet, Marin, Mira and Robert, 2012), so every estimate uses all
draws and stays consistent whatever the proposals were. Each new proposal is moment-matched to
the PSIS-weighted draws, with the weights tempered (``w^beta``, the largest ``beta <= 1`` that
keeps enough effective draws to fit a covariance, :func:`tempered_fit`): a step from the last
proposal towards the target, rather than a jump onto a handful of draws.

Example (a Gaussian target reached from a proposal a third as wide)::

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> target = lambda x: -0.5 * jnp.sum(x**2, -1)
    >>> prop = Proposal(jnp.zeros(2), 0.3 * jnp.eye(2), 7.0)          # t, 7 degrees of freedom
    >>> x = sample(jax.random.key(0), prop, 2000)
    >>> lw, khat = psis(np.asarray(target(x) - log_prob(prop, x)))
    >>> bool(khat > 0.7)                                  # flagged: the proposal is too narrow
    True
    >>> new = tempered_fit(np.asarray(x), lw, prop, min_ess=200)
    >>> bool(jnp.all(jnp.diag(new.scale_tril) > 0.4))     # a step towards the target's width
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.scipy.special import gammaln, logsumexp

from fedppl.algorithms import natural_gradient
from fedppl.algorithms.trio import Trio
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide

__all__ = ["Proposal", "Broadcast", "Estimates", "log_prob", "sample", "mixture_log_prob",
           "from_gaussian", "laplace_fit", "laplace_estimate", "laplace_log_marginal",
           "client_log_lik", "make_trio", "secure_summand", "secure_message", "REFUSALS",
           "psis", "ess", "weighted_moments", "tempered_fit",
           "leave_one_out", "resample"]

MIN_DRAWS = 100  # fewer draws leave too few in the tail for the Pareto fit (k-hat)


class Proposal(NamedTuple):
    """A multivariate Student t over ``theta``: location, lower Cholesky factor of the scale
    matrix, degrees of freedom (``inf`` for a Gaussian)."""

    mean: Array
    scale_tril: Array
    df: Array | float


class Broadcast(NamedTuple):
    """What the server sends every client in a round: the draws ``(S, D)`` of ``theta``."""

    draws: Array


def from_gaussian(q: g.Gaussian, df: float) -> Proposal:
    """The t (or, ``df = inf``, Gaussian) with ``q``'s mean and covariance as its scale."""
    mean, cov = g.to_moments(g.to_full(q))
    return Proposal(mean, jnp.linalg.cholesky(cov), jnp.asarray(df, mean.dtype))


def log_prob(p: Proposal, x: Array) -> Array:
    """Log density of the proposal at each row of ``x`` (``(S, D) -> (S,)``)."""
    D = p.mean.shape[-1]
    u = jax.scipy.linalg.solve_triangular(p.scale_tril, (x - p.mean).T, lower=True).T
    r2 = jnp.sum(u**2, -1)
    logdet = jnp.sum(jnp.log(jnp.diagonal(p.scale_tril)))
    gauss = -0.5 * r2 - 0.5 * D * jnp.log(2 * jnp.pi) - logdet
    df = jnp.asarray(p.df, x.dtype)
    nu = jnp.where(jnp.isfinite(df), df, 1.0)
    student = (gammaln(0.5 * (nu + D)) - gammaln(0.5 * nu) - 0.5 * D * jnp.log(nu * jnp.pi)
               - logdet - 0.5 * (nu + D) * jnp.log1p(r2 / nu))
    return jnp.where(jnp.isfinite(df), student, gauss)


def sample(key: Array, p: Proposal, num_draws: int) -> Array:
    """``num_draws`` draws ``(S, D)`` from the proposal."""
    k_norm, k_chi = jax.random.split(key)
    eps = jax.random.normal(k_norm, (num_draws, p.mean.shape[-1]), p.mean.dtype)
    x = eps @ p.scale_tril.T
    if np.isfinite(float(p.df)):
        chi2 = 2.0 * jax.random.gamma(k_chi, 0.5 * p.df, (num_draws,), p.mean.dtype)
        x = x * jnp.sqrt(p.df / chi2)[:, None]
    return p.mean + x


def mixture_log_prob(proposals: list[Proposal], counts: list[int], x: Array) -> Array:
    """Log density at ``x`` of the mixture of ``proposals`` weighted by their draw counts (the
    deterministic-mixture denominator of AMIS). One compiled program per number of proposals
    and of draws (the server evaluates it after every round, on every draw so far: op by op,
    each round's new shapes compiled each operation again)."""
    if len(proposals) != len(counts):
        raise ValueError(f"{len(proposals)} proposals but {len(counts)} draw counts")
    return _mixture_log_prob(tuple(proposals), np.asarray(counts, float), x)


@jax.jit
def _mixture_log_prob(proposals: tuple[Proposal, ...], counts: Array, x: Array) -> Array:
    logs = jnp.stack([log_prob(p, x) for p in proposals])
    counts = counts.astype(logs.dtype)
    return logsumexp(logs + jnp.log(counts)[:, None], axis=0) - jnp.log(jnp.sum(counts))


# -- the client's side ---------------------------------------------------------------------------

def laplace_fit(f: Callable[[Array], Array], z0: Array, newton_steps: int
                ) -> tuple[Array, Array]:
    """A Laplace approximation of ``exp(f)``: ``newton_steps`` Newton steps from ``z0`` (each the
    largest of ``1, 1/2, ..., 2^-10`` that raises ``f``; the Hessian's eigenvalues floored so
    that the step ascends), then the mode reached and the lower Cholesky factor of the
    (floored) negative Hessian there: ``N(mode, (chol chol')^-1)``. A deterministic function of
    ``z0`` and ``f``."""

    def precision(z):
        P = -jax.hessian(f)(z)
        vals, vecs = jnp.linalg.eigh(0.5 * (P + P.T))
        floor = 1e-6 * jnp.maximum(1.0, jnp.max(jnp.abs(vals)))
        return (vecs * jnp.maximum(vals, floor)) @ vecs.T

    def newton(_, z):
        step = jnp.linalg.solve(precision(z), jax.grad(f)(z))
        sizes = 2.0 ** -jnp.arange(11, dtype=z.dtype)
        cands = z + sizes[:, None] * step
        vals = jax.vmap(f)(cands)
        ok = jnp.isfinite(vals) & (vals >= f(z))
        return jnp.where(jnp.any(ok), cands[jnp.argmax(ok)], z)

    z = jax.lax.fori_loop(0, newton_steps, newton, z0)
    return z, jnp.linalg.cholesky(precision(z))


def laplace_estimate(f: Callable[[Array], Array], mode: Array, chol: Array, key: Array,
                     num_draws: int) -> tuple[Array, Array]:
    """``log int exp(f(z)) dz`` by importance sampling from ``N(mode, (chol chol')^-1)`` (a
    :func:`laplace_fit`): ``num_draws`` draws in antithetic pairs from the normal draws that
    ``key`` gives. The estimate of the integral (not of its log) is unbiased whatever the
    approximation; returns its log and the estimated variance of it, ``sum_i w_i^2 - 1 / num_draws``
    for the normalised weights (the delta method's ``var(w) / (M mean(w)^2)``)."""
    d = mode.shape[-1]
    half = jax.random.normal(key, (num_draws // 2, d), mode.dtype)
    eps = jnp.concatenate([half, -half])
    zs = mode + jax.scipy.linalg.solve_triangular(chol.T, eps.T, lower=False).T
    log_q = (-0.5 * jnp.sum(eps**2, -1) - 0.5 * d * jnp.log(2 * jnp.pi)
             + jnp.sum(jnp.log(jnp.diagonal(chol))))
    lw = jax.vmap(f)(zs) - log_q
    lw = jnp.where(jnp.isnan(lw), -jnp.inf, lw)
    total = logsumexp(lw)
    variance = jnp.sum(jnp.exp(2 * (lw - total))) - 1.0 / num_draws
    return total - jnp.log(num_draws), jnp.maximum(variance, 0.0)


def laplace_gradient(f: Callable[[Array, Array], Array], theta: Array, mode: Array) -> Array:
    """The gradient in ``theta`` of the Laplace approximation of ``log int exp(f(theta, z)) dz``
    at the mode ``z*`` (a :func:`laplace_fit` of ``f(theta, .)``): with ``P = -d2f/dz2`` and
    ``h = -log det(P) / 2`` (both at ``(theta, z*)``), and ``dz*/dtheta = P^-1 d2f/dz dtheta``,

        grad = df/dtheta + dh/dtheta + (d2f/dz dtheta)' P^-1 dh/dz

    (``df/dz = 0`` at the mode). Exact when ``f`` is quadratic in ``z``; otherwise its error is the
    Laplace approximation's, without Monte Carlo noise: a smooth deterministic function of
    ``theta`` and the mode. Where ``P`` is not positive definite there (a mode not reached),
    only ``df/dtheta``.

    >>> import jax.numpy as jnp
    >>> def f(t, z):                        # z ~ N(0, s^2 I), 1 = z + N(0, 1): 1 ~ N(0, 1 + s^2)
    ...     return (-0.5 * jnp.sum(z**2) * jnp.exp(-2 * t[0]) - z.size * t[0]
    ...             - 0.5 * jnp.sum((1.0 - z)**2))
    >>> t = jnp.array([0.3])                # log s
    >>> s2 = jnp.exp(2 * t[0])
    >>> z = jnp.full(2, s2 / (1 + s2))
    >>> bool(jnp.allclose(laplace_gradient(f, t, z), 2 * s2 * (1 / (1 + s2)**2 - 1 / (1 + s2))))
    True
    """

    def precision(t, z):
        P = -jax.hessian(lambda u: f(t, u))(z)
        return 0.5 * (P + P.T)

    def half_log_det(t, z):  # and P itself, built once
        P = precision(t, z)
        return -jnp.sum(jnp.log(jnp.diagonal(jnp.linalg.cholesky(P)))), P

    df = jax.grad(f)(theta, mode)
    (dh_t, dh_z), P = jax.grad(half_log_det, (0, 1), has_aux=True)(theta, mode)
    v = jnp.linalg.solve(P, dh_z)
    # (d2f/dz dtheta)' v as one reverse pass through df/dz . v, not a (d, D) Jacobian
    rest = dh_t + jax.grad(lambda t: jnp.dot(jax.grad(f, 1)(t, mode), v))(theta)
    return df + jnp.where(jnp.all(jnp.isfinite(rest)), rest, 0.0)


def laplace_log_marginal(f: Callable[[Array], Array], z0: Array, key: Array, num_draws: int,
                         newton_steps: int) -> tuple[Array, Array]:
    """``log int exp(f(z)) dz`` by importance sampling from a Laplace approximation of ``f``
    (:func:`laplace_fit` from ``z0``, then :func:`laplace_estimate`). Exact (up to rounding) when
    ``f`` is quadratic. Otherwise the estimate of the integral is unbiased and its log is biased
    down by about half its variance (Jensen), small wherever the Laplace approximation is good (a
    random effect given its group's data and the global parameters is close to Gaussian), large
    where the local posterior is far from Gaussian in many dimensions (tens of coefficients per
    client at a large group scale: the weights are heavy-tailed, and the variance estimate itself
    then understates the error)."""
    mode, chol = laplace_fit(f, z0, newton_steps)
    return laplace_estimate(f, mode, chol, key, num_draws)


class Estimates(NamedTuple):
    """A client's message: its log-likelihood at each draw ``(S,)`` and, with local sites, the
    estimated variance of each of those estimates ``(S,)`` (None without local sites: exact)."""

    log_lik: Array
    variance: Array | None = None


def client_log_lik(model: Callable, guide: PVIGuide, local_draws: int, newton_steps: int,
                   batch_size: int) -> Callable:
    """``(draws, local, data, mask, key) -> Estimates``: a client's log-likelihood at each draw
    of ``theta`` (with local sites, its log marginal likelihood by
    :func:`laplace_log_marginal`, started from its private guide's conditional mean ``local``
    when it has one, and the variance of that estimate)."""

    def fn(draws, local, data, mask, key):
        log_lik = natural_gradient.log_lik_fn(model, guide, data, mask)
        if guide.local_layout is None:
            return Estimates(jax.lax.map(lambda th: log_lik(th, jnp.zeros((), int)), draws,
                                         batch_size=batch_size))
        d = guide.local_layout.dim

        def one(inputs):
            theta, k = inputs
            z0 = (jnp.zeros(d, theta.dtype) if local is None else
                  jnp.linalg.solve(local.prec, local.nat1 - local.cross @ theta))
            seed = jnp.zeros((), int)
            return laplace_log_marginal(lambda z: log_lik(jnp.concatenate([theta, z]), seed),
                                        z0, k, local_draws, newton_steps)

        keys = jax.random.split(key, draws.shape[0])
        return Estimates(*jax.lax.map(one, (draws, keys), batch_size=batch_size))

    return fn


def make_trio(log_lik: Callable) -> Trio:
    """The exchange as a trio: a client's message is its :class:`Estimates` at the broadcast
    draws; the server keeps its state (the weights are formed on the host, :func:`psis`)."""

    def client_update(server: Broadcast, local: Any, data, mask, key, index):
        return log_lik(server.draws, local, data, mask, key), local

    def server_update(server, messages, index, received, key, evaluate):
        return server, received

    return Trio(client_update, server_update)


# -- under secure aggregation (fedppl.runtime.secure) ---------------------------------------------

#: Why a client withholds its log-likelihoods from a secure sum (a verdict <= 0; 1: it sends).
NOT_FINITE, BEYOND_SCALE, RULED_OUT = -1.0, -2.0, -3.0
REFUSALS = {
    NOT_FINITE: "refused at the client before secure aggregation: log-likelihoods NaN or +inf "
                "(or a variance not finite and non-negative)",
    BEYOND_SCALE: "refused at the client before secure aggregation: a log-likelihood or "
                  "variance beyond the secure sum's scale (SecureSum.scale, public); raise the "
                  "scale",
    RULED_OUT: "refused at the client before secure aggregation: its data have zero "
               "likelihood at every draw",
}


def secure_summand(message: Estimates, scale: float) -> tuple[Estimates, Array]:
    """What a client adds into a secure sum in place of its :class:`Estimates`, and its verdict
    (the server's check of the message, made by the client: 1, or a code of :data:`REFUSALS`):
    finite, within ``scale``, not zero likelihood at every draw. A ``-inf`` log-likelihood (a
    draw its data rule out) enters as ``-scale``, the lowest entry the sum carries, so the
    total at that draw is at most ``-scale + (n - 1) m`` (``m``: the largest ``|l_k|`` of the
    other clients) and its likelihood relative to any draw's at most
    ``exp(-(scale - (2n - 1) m))``: negligible where the scale is well above ``2 n m``, not
    zero."""
    ll = message.log_lik
    ruled_out = jnp.isneginf(ll)
    finite = ~jnp.any(jnp.isnan(ll) | jnp.isposinf(ll))
    within = jnp.all(ruled_out | (jnp.abs(ll) <= scale))
    var = message.variance
    if var is not None:
        finite = finite & jnp.all(jnp.isfinite(var) & (var >= 0))
        within = within & jnp.all(var <= scale)
    verdict = jnp.where(~finite, NOT_FINITE, jnp.where(
        jnp.all(ruled_out), RULED_OUT, jnp.where(within, 1.0, BEYOND_SCALE)))
    sends = verdict > 0
    summand = Estimates(jnp.where(sends, jnp.where(ruled_out, -scale, ll), 0.0),
                        None if var is None else jnp.where(sends, var, 0.0))
    return summand, verdict


def secure_message(server: Any, total: Estimates, n: Array) -> Estimates:
    """One of ``n`` equal messages whose sum is ``total`` (the clients' summed log-likelihoods
    and variances at each draw): what the server's record adds up again."""
    return jax.tree_util.tree_map(lambda x: x / n, total)


# -- the server's side (host, NumPy) --------------------------------------------------------------

def psis(log_ratios: np.ndarray) -> tuple[np.ndarray, float]:
    """Pareto-smoothed, normalised log weights and k-hat (arviz-stats' PSIS, Vehtari et al.,
    2024) of raw log importance ratios ``(N,)``; ``-inf`` ratios (zero likelihood) keep zero
    weight. Equal ratios (the proposal is the target) give equal weights and ``k = -inf``; too
    few draws to fit a tail (under 25) or a tail of ties give the raw weights and ``k = inf``
    (as ArviZ 0.x's ``psislw`` did)."""
    from fedppl.arviz import arviz_stats

    arviz_stats()  # the extra's error message if it is missing
    from arviz_stats.base import array_stats

    lr = np.asarray(log_ratios, np.float64)
    finite = np.isfinite(lr)
    out = np.full(lr.shape, -np.inf)
    if not finite.any():
        return out, np.inf
    x = lr[finite] - lr[finite].max()
    if np.ptp(x) < 1e-6:  # the proposal is the target, to rounding: equal weights
        out[finite] = -np.log(finite.sum())
        return out, -np.inf
    try:  # arviz-stats smooths the right tail of -x (its input is a log-likelihood)
        lw, khat = array_stats.psislw(-x, r_eff=1.0)
    except ValueError:  # fewer than 5 tail draws, or all tied: no tail to fit
        lw, khat = x - np.logaddexp.reduce(x), np.inf
    out[finite] = lw
    return out, float(khat)


def ess(log_weights: np.ndarray) -> float:
    """Effective sample size ``1 / sum w^2`` of normalised log weights."""
    return float(1.0 / np.sum(np.exp(2 * np.asarray(log_weights))))


def weighted_moments(draws: np.ndarray, log_weights: np.ndarray) -> tuple[np.ndarray,
                                                                          np.ndarray]:
    """Mean and covariance of ``draws`` under normalised log weights."""
    w = np.exp(np.asarray(log_weights))
    w = w / w.sum()
    mean = w @ draws
    centred = draws - mean
    return mean, (centred * w[:, None]).T @ centred


def tempered_fit(draws: np.ndarray, log_ratios: np.ndarray, previous: Proposal,
                 min_ess: float, df: float | None = None,
                 anchor: Proposal | None = None) -> Proposal:
    """The next proposal: moment-matched to the draws weighted by ``w^beta``, ``beta`` the
    largest in (0, 1] whose smoothed weights keep ``min_ess`` effective draws (found by
    bisection), a t with ``df`` degrees of freedom (default: the previous proposal's).

    A covariance from a few hundred effective draws in tens of dimensions is noisy, and a noisy
    scale matrix costs a t proposal most of its efficiency. So the weighted covariance is shrunk
    towards the weighted variances joined by the correlations of ``anchor`` (the first proposal,
    the answer being refined; default ``previous``), by ``min(1, 3 D / (ESS + D))``: the
    marginal widths move at once, the correlations as the effective draws allow. (Shrinking
    towards the previous fit instead lets each round's noise in the correlations carry over.)"""
    lr = np.asarray(log_ratios, np.float64)

    def smoothed(beta):
        return psis(beta * lr)[0]

    lo, hi, lw = 0.0, 1.0, smoothed(1.0)
    if ess(lw) < min_ess:
        for _ in range(20):
            mid = 0.5 * (lo + hi)
            if ess(smoothed(mid)) >= min_ess:
                lo = mid
            else:
                hi = mid
        lw = smoothed(max(lo, 1e-6))
    mean, cov = weighted_moments(draws, lw)
    D, n_eff = draws.shape[1], ess(lw)
    shrink = min(1.0, 3.0 * D / (n_eff + D))
    old = np.asarray((previous if anchor is None else anchor).scale_tril, np.float64)
    old = old @ old.T
    corr = old / np.sqrt(np.outer(np.diag(old), np.diag(old)))
    sd = np.sqrt(np.diag(cov))
    cov = (1 - shrink) * cov + shrink * corr * np.outer(sd, sd)
    cov = cov + 1e-10 * np.trace(cov) / D * np.eye(D)
    dtype = previous.mean.dtype
    return Proposal(jnp.asarray(mean, dtype), jnp.asarray(np.linalg.cholesky(cov), dtype),
                    jnp.asarray(previous.df if df is None else df, dtype))


def leave_one_out(log_ratios: np.ndarray, log_lik: np.ndarray) -> tuple[np.ndarray,
                                                                         np.ndarray]:
    """Each client's leave-one-client-out log predictive density ``log p(y_k | y_-k)`` and its
    k-hat, from the raw log ratios of the pooled posterior ``(N,)`` and the clients'
    log-likelihoods ``(K, N)``: the ratios ``log w - l_k`` target the posterior without client
    ``k`` and are smoothed per client."""
    elpd, khat = [], []
    for ll in np.asarray(log_lik, np.float64):
        lw, k = psis(np.asarray(log_ratios) - ll)
        keep = np.isfinite(lw)
        elpd.append(float(logsumexp(jnp.asarray(lw[keep] + ll[keep]))))
        khat.append(k)
    return np.asarray(elpd), np.asarray(khat)


def resample(key: Array, log_weights: np.ndarray, num_samples: int) -> np.ndarray:
    """Indices of ``num_samples`` draws resampled by their weights (systematic resampling:
    the least added noise for a given number of draws)."""
    w = np.exp(np.asarray(log_weights, np.float64))
    cdf = np.cumsum(w / w.sum())
    u = (float(jax.random.uniform(key)) + np.arange(num_samples)) / num_samples
    return np.minimum(np.searchsorted(cdf, u), len(w) - 1)
