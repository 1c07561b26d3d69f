"""Exact federated Bayesian linear regression from sufficient statistics (FedBNR phase 2).

For ``y = Phi w + noise``, ``w ~ N(0, lambda^2 I)``, the posterior depends on the data only through
``S = Phi^T Phi`` and ``b = Phi^T y``, which add up over clients (FedBNR paper, Eqs. 20-21):

    A = S / sigma^2 + I / lambda^2,    w_bar = A^-1 b / sigma^2.

Each client sends :class:`Stats` (``S``, ``b`` and its count): sizes fixed by the feature dimension,
never by its number of points. A client's statistics are exactly its likelihood as a Gaussian
factor in ``w`` (:func:`likelihood_factor`), so the server's posterior is the prior times the sum
of the factors, computed with :mod:`fedppl.families.gaussian`.

Example::

    >>> import jax
    >>> Phi = jax.random.normal(jax.random.key(0), (30, 4))
    >>> y = Phi @ jax.numpy.array([1.0, -1.0, 0.5, 0.0])
    >>> parts = [(Phi[:10], y[:10]), (Phi[10:], y[10:])]
    >>> msgs = [client_stats(Phi_k, y_k) for Phi_k, y_k in parts]      # on the clients
    >>> post = posterior(aggregate(msgs), noise=0.5, prior_scale=1.0)  # on the server
    >>> mean, var = predict(post, Phi[:3], noise=0.5)
    >>> mean.shape, bool((var > 0.25).all())                           # noise variance included
    ((3,), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jax import Array

from fedppl import trees
from fedppl.families import gaussian as g

__all__ = ["Stats", "client_stats", "validate", "aggregate", "add_up", "all_finite",
           "likelihood_factor", "posterior", "solve", "predict", "log_marginal_likelihood",
           "data_log_marginal_likelihood"]

REFINE_STEPS = 20  # conjugate-gradient steps of :func:`solve`


class Stats(NamedTuple):
    """What a client sends: ``scatter = Phi^T Phi (D, D)``, ``proj = Phi^T y (D,)``, ``count``."""

    scatter: Array
    proj: Array
    count: Array  # type: ignore[assignment]  # the field shadows tuple.count (kept: public)


def client_stats(features: Array, y: Array, mask: Array | None = None) -> Stats:
    """Sufficient statistics of one client's (optionally padded and masked) data."""
    if mask is not None:
        features = features * mask[:, None]
        y = y * mask
        count = jnp.sum(mask)
    else:
        count = jnp.asarray(features.shape[0])
    return Stats(features.T @ features, features.T @ y, count)


def validate(stats: Stats, dim: int, who: str = "client") -> None:
    """Host-side checks of a received message; raises ``ValueError`` naming the sender."""
    scatter, proj = np.asarray(stats.scatter), np.asarray(stats.proj)
    if scatter.shape != (dim, dim) or proj.shape != (dim,):
        raise ValueError(f"{who} sent statistics of shapes {scatter.shape} and {proj.shape}; the "
                         f"global features have dimension {dim}")
    if not (np.all(np.isfinite(scatter)) and np.all(np.isfinite(proj))
            and np.isfinite(stats.count)):
        raise ValueError(f"{who} sent non-finite statistics")
    if float(stats.count) < 0:
        raise ValueError(f"{who} sent a negative count")
    if not np.allclose(scatter, scatter.T, rtol=1e-8, atol=1e-8 * (1 + np.abs(scatter).max())):
        raise ValueError(f"{who} sent a scatter matrix that is not symmetric")


def aggregate(messages: Sequence[Stats], names: Sequence[str] | None = None) -> Stats:
    """Validate every message (naming the client at fault) and add them up."""
    if len(messages) == 0:
        raise ValueError("no client statistics to aggregate")
    names = list(names) if names is not None else [f"client {k}" for k in range(len(messages))]
    dim = np.shape(messages[0].proj)[0]
    for m, who in zip(messages, names, strict=True):
        validate(m, dim, who)
    # in order, client 0 first (add_up makes the same additions inside compiled code)
    total = [sum(np.asarray(m[i], dtype=np.float64) for m in messages) for i in range(3)]
    if float(total[2]) == 0:
        raise ValueError("no client holds any data: the posterior would be the prior alone")
    return Stats(*(jnp.asarray(x) for x in total))


def add_up(stats: Stats) -> Stats:
    """The sum of statistics stacked on axis 0, in order (client 0 first), inside compiled code:
    the same additions, in the same order, as :func:`aggregate` makes on the host."""
    def step(total, one):
        return jax.tree_util.tree_map(jnp.add, total, one), None

    return jax.lax.scan(step, trees.first(stats), trees.index(stats, slice(1, None)))[0]


def all_finite(stats: Stats) -> Array:
    """Whether every statistic is finite (one boolean for the whole pytree)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in stats]))


def likelihood_factor(stats: Stats, noise: Array | float) -> g.FullGaussian:
    """The likelihood of the data behind ``stats`` as a Gaussian factor in ``w``."""
    return g.FullGaussian(stats.proj / noise**2, stats.scatter / noise**2)


def posterior(stats: Stats, noise: Array | float, prior_scale: Array | float) -> g.FullGaussian:
    """``N(w_bar, A^-1)`` in natural parameters: the prior times the likelihood factor."""
    dim = stats.proj.shape[-1]
    prior = g.FullGaussian(jnp.zeros(dim), jnp.eye(dim) / prior_scale**2)
    return g.FullGaussian(*g.product(prior, likelihood_factor(stats, noise)))


def solve(prec: Array, rhs: Array, steps: int = REFINE_STEPS) -> tuple[Array, Array]:
    """``prec^-1 rhs`` for a positive definite ``prec``, and the factor used: the lower
    Cholesky factor of ``prec`` plus the dtype's jitter floor (:func:`g.jittered_cholesky`),
    refined by ``steps`` of conjugate gradients on ``prec`` itself preconditioned by it, so
    that the floor does not bias the solution where ``prec`` is ill-conditioned (float32, a
    small noise); differentiated implicitly (``jax.lax.custom_linear_solve``)."""
    chol = g.jittered_cholesky(prec)
    fixed = jax.lax.stop_gradient(chol)

    def cg(matvec, b):
        precondition = lambda r: jsl.cho_solve((fixed, True), r)  # noqa: E731
        x = precondition(b)
        r = b - matvec(x)
        z = precondition(r)

        def step(_, carry):
            x, r, z, p = carry
            rz, Ap = r @ z, matvec(p)
            pAp = p @ Ap
            a = jnp.where(pAp > 0, rz / jnp.where(pAp > 0, pAp, 1), 0)
            x, r = x + a * p, r - a * Ap
            z2 = precondition(r)
            beta = jnp.where(rz > 0, (r @ z2) / jnp.where(rz > 0, rz, 1), 0)
            return x, r, z2, z2 + beta * p

        return jax.lax.fori_loop(0, steps, step, (x, r, z, z))[0]

    return jax.lax.custom_linear_solve(lambda v: prec @ v, rhs, cg, symmetric=True), chol


def predict(post: g.FullGaussian, features: Array, noise: Array | float) -> tuple[Array, Array]:
    """Predictive mean and variance (observation noise included) at ``features (n, D)``."""
    mean, chol = solve(post.prec, post.nat1)
    half = jsl.solve_triangular(chol, features.T, lower=True)
    return features @ mean, jnp.sum(half**2, axis=0) + noise**2


def log_marginal_likelihood(stats: Stats, yy: Array, noise: Array, prior_scale: Array) -> Array:
    """``log N(y | 0, sigma^2 I + lambda^2 Phi Phi^T)`` from the statistics and ``yy = y^T y``."""
    dim = stats.proj.shape[-1]
    A = stats.scatter / noise**2 + jnp.eye(dim) / prior_scale**2
    chol = g.jittered_cholesky(A)  # floored jitter: finite in float32 too (g.jitter_floor)
    half = jsl.solve_triangular(chol, stats.proj / noise**2, lower=True)
    return (-0.5 * stats.count * jnp.log(2 * jnp.pi * noise**2) - dim * jnp.log(prior_scale)
            - jnp.sum(jnp.log(jnp.diagonal(chol))) - 0.5 * (yy / noise**2 - half @ half))


def data_log_marginal_likelihood(features: Array, y: Array, noise: Array, prior_scale: Array,
                                 mask: Array | None = None) -> Array:
    """:func:`log_marginal_likelihood` from the data themselves, in a form float32 resolves
    when the noise is small: the data-fit term as ``||y - Phi w_bar||^2 / sigma^2 +
    ||w_bar||^2 / lambda^2`` (two non-negative terms, stationary in ``w_bar``), not as the
    difference ``y^T y / sigma^2 - b^T A^-1 b / sigma^4`` of two numbers of order
    ``N / sigma^2``; and ``A`` jittered only by what the dtype's floor asks beyond the prior
    precision ``1 / lambda^2`` that every eigenvalue already has. Masked rows count for
    nothing."""
    stats = client_stats(features, y, mask)
    if mask is not None:
        features, y = features * mask[:, None], y * mask
    dim = stats.proj.shape[-1]
    A = stats.scatter / noise**2 + jnp.eye(dim, dtype=features.dtype) / prior_scale**2
    shift = jnp.maximum(g.jitter_floor(A) - 1 / prior_scale**2, 0.0)
    chol = jnp.linalg.cholesky(A + shift * jnp.eye(dim, dtype=A.dtype))
    mean = jsl.cho_solve((chol, True), stats.proj / noise**2)
    residual = y - features @ mean
    fit = residual @ residual / noise**2 + mean @ mean / prior_scale**2
    return (-0.5 * stats.count * jnp.log(2 * jnp.pi * noise**2) - dim * jnp.log(prior_scale)
            - jnp.sum(jnp.log(jnp.diagonal(chol))) - 0.5 * fit)
