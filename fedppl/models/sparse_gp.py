"""Sparse variational GP: the NumPyro model of a client's free energy and its linear algebra.

The approximate posterior over the inducing outputs ``u = f(Z)`` is ``q(u) ∝ p(u) prod_k t_k(u)``
where every factor is summarised, for given ``(Z, beta)``, by ``B_k`` (M x M, PSD) and ``b_k`` (M)
such that ``t_k(u) ∝ exp(u' K^-1 b_k - u' K^-1 B_k K^-1 u / 2)`` (``K = K_ZZ + jitter I``). Then

    Cov[u] = K (K + B)^-1 K,   E[u] = K (K + B)^-1 b,   B = sum_k B_k, b = sum_k b_k,

computed in whitened coordinates ``v = L^-1 u`` (``K = L L'``): ``q(v) = N(P^-1 c, P^-1)`` with
``P = I + L^-1 B L^-T`` and ``c = L^-1 b``. Only M x M matrices are factorised (cost
``O(sum_k M_k M^2 + M^3)``); no N x N or (sum M_k) x (sum M_k) matrix is ever formed.

The log hyperparameters ``log_beta = [log lengthscale (D), log variance, log noise]`` (no noise for
the Bernoulli likelihood) carry LogNormal(0, 1) priors; :func:`split_hyper` reads them as a
:class:`~fedppl.models.kernels.SEParams`. :func:`collapsed_bound` is Titsias' collapsed bound (the
objective FSGP averages, and the reference the federated free energy is tested against).

Example::

    >>> import jax.numpy as jnp
    >>> from fedppl.models.kernels import SEParams
    >>> X = jnp.linspace(-1.0, 1.0, 6)[:, None]
    >>> y = jnp.sin(3.0 * X[:, 0])
    >>> hyper = SEParams.init(1, lengthscale=0.5, noise=0.1)
    >>> L = jnp.linalg.cholesky(kzz(X, hyper))              # inducing points at the data
    >>> post = posterior(L, jnp.zeros((6, 6)), jnp.zeros(6))  # the prior, whitened
    >>> mean, var = predict_f(post, hyper.kernel(X, X), jnp.full(6, hyper.variance))
    >>> float(jnp.max(jnp.abs(mean)))                          # the prior's mean
    0.0
    >>> [round(float(collapsed_bound(X, y, Z, hyper)), 2) for Z in (X, X[::2])]  # Z = X is best
    [-4.73, -71.77]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array

from fedppl.families import gaussian as g
from fedppl.models.kernels import SEParams, se

__all__ = ["JITTER", "num_hyper", "split_hyper", "kzz", "Whitened", "posterior",
           "posterior_from_B", "moments", "predict_f", "kl_whitened", "expected_log_lik",
           "masked", "collapsed_bound", "local_model"]

JITTER = 1e-6
_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(32)  # probabilists' Gauss-Hermite


def num_hyper(input_dim: int, likelihood: str) -> int:
    """Length of ``log_beta``: D lengthscales, the variance and (Gaussian only) the noise sd."""
    return input_dim + (2 if likelihood == "gaussian" else 1)


def split_hyper(log_beta: Array, input_dim: int) -> SEParams:
    """``log_beta`` as kernel hyperparameters (noise sd 1 when it has no noise entry)."""
    log_noise = log_beta[input_dim + 1] if log_beta.shape[-1] > input_dim + 1 else jnp.asarray(0.0)
    return SEParams(log_beta[:input_dim], log_beta[input_dim], log_noise)


def kzz(Z: Array, hyper: SEParams, jitter: float = JITTER, relative: bool = True) -> Array:
    """``K_ZZ + jitter I``, the jitter times the kernel variance when ``relative``, and at
    least :func:`fedppl.families.gaussian.jitter_floor` (``10 eps tr(K_ZZ)``, ``1.2e-4`` of the
    variance for 100 points in float32; it binds only there: see its doc)."""
    K = se(Z, Z, hyper.lengthscale, hyper.variance)
    shift = jitter * hyper.variance if relative else jitter
    shift = jnp.maximum(shift, g.jitter_floor(K))
    return K + shift * jnp.eye(Z.shape[0], dtype=K.dtype)


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
    """Mean and covariance of ``u`` (``O(M^3)``)."""
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


def masked(X: Array, y: Array, mask: Array | None) -> tuple[Array, Array, Array]:
    """Zero the padded rows (with ``where``, so NaN padding cannot leak into values or grads)."""
    if mask is None:
        return X, y, jnp.ones(X.shape[0], dtype=bool)
    mask = jnp.asarray(mask, dtype=bool)
    return jnp.where(mask[:, None], X, 0.0), jnp.where(mask, y, 0.0), mask


def collapsed_bound(X: Array, y: Array, Z: Array, hyper: SEParams, mask: Array | None = None,
                    jitter: float = JITTER, relative: bool = True) -> Array:
    """Titsias' collapsed bound ``log N(y | 0, Q + s2 I) - tr(K_NN - Q) / (2 s2)`` in nats.

    ``Q = K_NZ K_ZZ^-1 K_ZN`` (``K_ZZ`` from :func:`kzz` with ``jitter`` and ``relative``); rows
    with ``mask == False`` are ignored (N counts real rows). Computed through Cholesky factors of
    ``K_ZZ`` and ``I + L^-1 K_ZN K_NZ L^-T / s2`` (``O(N M^2)``).
    """
    X, y, mask = masked(X, y, mask)
    s2 = hyper.noise_var
    n = jnp.sum(mask)
    L = jnp.linalg.cholesky(kzz(Z, hyper, jitter, relative))
    Kuf = jnp.where(mask[None, :], hyper.kernel(Z, X), 0.0)
    A = jsl.solve_triangular(L, Kuf, lower=True) / jnp.sqrt(s2)  # (M, N)
    AAT = A @ A.T
    LB = jnp.linalg.cholesky(jnp.eye(AAT.shape[0]) + AAT)
    c = jsl.solve_triangular(LB, A @ y, lower=True) / jnp.sqrt(s2)
    trace_knn = n * hyper.variance  # SE kernel: diagonal is the variance
    return (-0.5 * n * jnp.log(2.0 * jnp.pi * s2) - jnp.sum(jnp.log(jnp.diagonal(LB)))
            - 0.5 * (y @ y) / s2 + 0.5 * (c @ c)
            - 0.5 * trace_knn / s2 + 0.5 * jnp.trace(AAT))


def local_model(u_term: Callable[[Any, Any], Array], beta_cavity: tuple[Array, Array] | None,
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
