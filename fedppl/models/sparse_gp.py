"""Sparse variational GP: the NumPyro model of a client's free energy and its linear algebra.

The approximate posterior over the inducing outputs ``u = f(Z)`` is ``q(u) ∝ p(u) prod_k t_k(u)``
where every factor is summarised, for given ``(Z, beta)``, by ``B_k`` (M x M, PSD) and ``b_k`` (M)
such that ``t_k(u) ∝ exp(u' K^-1 b_k - u' K^-1 B_k K^-1 u / 2)`` (``K = K_ZZ + jitter I``). Then

    Cov[u] = K (K + B)^-1 K,   E[u] = K (K + B)^-1 b,   B = sum_k B_k, b = sum_k b_k,

computed in whitened coordinates ``v = L^-1 u`` (``K = L L'``): ``q(v) = N(P^-1 c, P^-1)`` with
``P = I + L^-1 B L^-T`` and ``c = L^-1 b``. Only M x M matrices are factorised (cost
``O(sum_k M_k M^2 + M^3)``); no N x N or (sum M_k) x (sum M_k) matrix is ever formed.

The log hyperparameters ``log_beta = [log lengthscale (D), log variance, log noise]`` (no noise for
the Bernoulli likelihood) carry LogNormal(0, 1) priors.

Example::

    >>> post = posterior_from_B(kzz(Z, hyper), B, b)     # whitened q(u)
    >>> mean, var = predict_f(post, se(X, Z, ls, var), jnp.full(len(X), var))
    >>> ell = expected_log_lik("gaussian", y, mean, var, noise, mask)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array

from fedppl.models.kernels import se

__all__ = ["JITTER", "Hyper", "num_hyper", "split_hyper", "kzz", "Whitened", "posterior",
           "posterior_from_B", "moments", "predict_f", "kl_whitened", "expected_log_lik", "titsias_elbo",
           "local_model"]

JITTER = 1e-6
_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(32)  # probabilists' Gauss-Hermite


class Hyper(NamedTuple):
    lengthscale: Array
    variance: Array
    noise: Array  # observation noise standard deviation (unused for Bernoulli)


def num_hyper(input_dim: int, likelihood: str) -> int:
    """Length of ``log_beta``: D lengthscales, the variance and (Gaussian only) the noise sd."""
    return input_dim + (2 if likelihood == "gaussian" else 1)


def split_hyper(log_beta: Array, input_dim: int) -> Hyper:
    beta = jnp.exp(log_beta)
    noise = beta[input_dim + 1] if beta.shape[-1] > input_dim + 1 else jnp.asarray(1.0)
    return Hyper(beta[:input_dim], beta[input_dim], noise)


def kzz(Z: Array, hyper: Hyper, jitter: float = JITTER) -> Array:
    """``K_ZZ + jitter * variance * I`` (the jitter is relative to the kernel variance)."""
    K = se(Z, Z, hyper.lengthscale, hyper.variance)
    return K + jitter * hyper.variance * jnp.eye(Z.shape[0], dtype=K.dtype)


class Whitened(NamedTuple):
    """``q(u)`` in whitened form: ``L = chol(K)``, ``C = chol(P)``, ``c = L^-1 b``."""

    L: Array
    C: Array
    c: Array


def posterior(L: Array, A: Array, c: Array) -> Whitened:
    """Whitened ``q(u)`` from ``L = chol(K)``, ``A = L^-1 B L^-T`` and ``c = L^-1 b``.

    Factors supply ``A`` and ``c`` directly (e.g. ``A = W S^-1 W'`` with ``W = L^-1 K_ZV``), which
    keeps ``A`` PSD to rounding even when ``K`` is ill-conditioned."""
    P = jnp.eye(L.shape[0], dtype=L.dtype) + 0.5 * (A + A.T)
    return Whitened(L, jnp.linalg.cholesky(P), c)


def posterior_from_B(K: Array, B: Array, b: Array) -> Whitened:
    """Whitened ``q(u) ∝ p(u) exp(u'K^-1 b - u'K^-1 B K^-1 u / 2)`` from ``(B, b)``."""
    L = jnp.linalg.cholesky(K)
    half = jsl.solve_triangular(L, B, lower=True)
    A = jsl.solve_triangular(L, half.T, lower=True)
    return posterior(L, A, jsl.solve_triangular(L, b, lower=True))


def _vmean(w: Whitened) -> Array:
    return jsl.cho_solve((w.C, True), w.c)


def moments(w: Whitened) -> tuple[Array, Array]:
    """Mean and covariance of ``u`` (for tests and inspection; ``O(M^3)``)."""
    half = jsl.solve_triangular(w.C, w.L.T, lower=True)  # C^-1 L'
    return w.L @ _vmean(w), half.T @ half


def predict_f(w: Whitened, Kxz: Array, kxx_diag: Array) -> tuple[Array, Array]:
    """Marginal mean and variance of ``f(X)`` under ``q(f) = int p(f|u) q(u) du``."""
    W = jsl.solve_triangular(w.L, Kxz.T, lower=True)      # L^-1 K_ZX  (M, N)
    G = jsl.solve_triangular(w.C, W, lower=True)          # C^-1 L^-1 K_ZX
    mean = W.T @ _vmean(w)
    var = kxx_diag - jnp.sum(W**2, axis=0) + jnp.sum(G**2, axis=0)
    return mean, jnp.maximum(var, 1e-12)


def kl_whitened(q: Whitened, p: Whitened) -> Array:
    """``KL(q(u) || p(u))`` for two whitened Gaussians sharing ``L`` (the same ``Z, beta``)."""
    m = q.C.shape[0]
    mq, mp = _vmean(q), _vmean(p)
    Pp = p.C @ p.C.T
    trace = jnp.sum(jsl.solve_triangular(q.C, p.C, lower=True) ** 2)  # tr(P_q^-1 P_p)
    d = mq - mp
    logdet = 2.0 * (jnp.sum(jnp.log(jnp.diagonal(q.C))) - jnp.sum(jnp.log(jnp.diagonal(p.C))))
    return 0.5 * (trace + d @ Pp @ d - m + logdet)


def expected_log_lik(likelihood: str, y: Array, mean: Array, var: Array, noise: Array,
                     mask: Array | None = None) -> Array:
    """``sum_n mask_n E_{N(f; mean_n, var_n)}[log p(y_n | f)]`` (closed form or Gauss-Hermite)."""
    if likelihood == "gaussian":
        terms = -0.5 * jnp.log(2 * jnp.pi * noise**2) - 0.5 * ((y - mean) ** 2 + var) / noise**2
    elif likelihood == "bernoulli":
        f = mean[:, None] + jnp.sqrt(var)[:, None] * _GH_X[None, :]
        logp = y[:, None] * f - jnp.logaddexp(0.0, f)
        terms = logp @ (_GH_W / np.sqrt(2 * np.pi))
    else:
        raise ValueError(f"likelihood must be 'gaussian' or 'bernoulli', got {likelihood!r}")
    return jnp.sum(terms if mask is None else jnp.where(mask, terms, 0.0))


def titsias_elbo(X: Array, y: Array, Z: Array, hyper: Hyper, jitter: float = JITTER) -> Array:
    """Closed-form collapsed bound of Titsias (2009): ``log N(y|0, Q + s2 I) - tr(K - Q)/(2 s2)``.

    Uses the Woodbury identity (``O(N M^2)``). A reference for the free energy estimator."""
    s2 = hyper.noise**2
    K = kzz(Z, hyper, jitter)
    L = jnp.linalg.cholesky(K)
    W = jsl.solve_triangular(L, se(Z, X, hyper.lengthscale, hyper.variance), lower=True)
    Pm = jnp.eye(Z.shape[0]) + W @ W.T / s2
    Cp = jnp.linalg.cholesky(Pm)
    r = jsl.solve_triangular(Cp, W @ y, lower=True) / s2
    n = y.shape[0]
    quad = y @ y / s2 - r @ r
    logdet = n * jnp.log(s2) + 2 * jnp.sum(jnp.log(jnp.diagonal(Cp)))
    trace = (n * hyper.variance - jnp.sum(W**2)) / s2
    return -0.5 * (n * jnp.log(2 * jnp.pi) + logdet + quad + trace)


def local_model(u_term: Callable[[Array, Array], Array], beta_cavity: tuple[Array, Array] | None,
                z_cavity: tuple[Array, Array] | None, log_beta: Array | None = None,
                Z: Array | None = None) -> None:
    """The client's model with the cavity in place of the prior (PVI's local free energy).

    Sites: ``log_beta ~ N(cavity)`` (LogNormal in beta) unless ``log_beta`` is given (fixed
    hyperparameters), ``Z ~ N(cavity)`` (fully factorised) unless ``Z`` is given (a point
    estimate), and a factor ``u_term(log_beta, Z)`` = expected log-likelihood of the client's
    data minus ``KL(q(u|Z,beta) || q_cavity(u|Z,beta))``, both analytic given ``(beta, Z)``.
    Wrap with :func:`fedppl.handlers.tempered` on ``"Z"`` (model and guide) for the alpha-KL.
    """
    if beta_cavity is not None:
        log_beta = numpyro.sample("log_beta", dist.Normal(*beta_cavity).to_event(1))
    if z_cavity is not None:
        Z = numpyro.sample("Z", dist.Normal(*z_cavity).to_event(2))
    numpyro.factor("u_term", u_term(log_beta, Z))
