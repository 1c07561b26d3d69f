"""Dense references for the structured variational GPs (float64 NumPy, ``O(M^3)``).

``hensman_bound`` is Eq. 1.34 for any ``q(u) = N(m, S)``: every structured bound must equal it
for the ``(m, S)`` its guide describes. ``titsias_bound`` and ``exact_lml`` are the collapsed bound
and the exact log marginal likelihood of the same model (prior ``K_uu``, cross-covariances
``K_fu``, prior variances ``kff``).
"""

from __future__ import annotations

import jax
import numpy as np
from scipy.stats import multivariate_normal

from fedppl.models import svgp


def hensman_bound(y, m, S, K, Kfu, kff, s2):
    y, m, S, K, Kfu, kff = (np.asarray(a, dtype=float) for a in (y, m, S, K, Kfu, kff))
    A = np.linalg.solve(K, Kfu.T)                       # K^-1 k_i
    mean = A.T @ m
    var = kff - np.sum(Kfu.T * A, axis=0) + np.einsum("mi,mn,ni->i", A, S, A)
    data = np.sum(-0.5 * np.log(2 * np.pi * s2) - 0.5 * ((y - mean) ** 2 + var) / s2)
    M = K.shape[0]
    kl = 0.5 * (np.trace(np.linalg.solve(K, S)) + m @ np.linalg.solve(K, m) - M
                - np.linalg.slogdet(S)[1] + np.linalg.slogdet(K)[1])
    return data - kl


def predictive(m, S, K, Kfu, kff):
    """Mean and variance of ``f`` at the rows of ``Kfu`` under ``q(u) = N(m, S)``."""
    A = np.linalg.solve(np.asarray(K), np.asarray(Kfu).T)
    return A.T @ m, kff - np.sum(np.asarray(Kfu).T * A, 0) + np.einsum("mi,mn,ni->i", A, S, A)


def titsias_bound(y, K, Kfu, kff, s2):
    Q = Kfu @ np.linalg.solve(K, Kfu.T)
    n = len(y)
    return (multivariate_normal(np.zeros(n), Q + s2 * np.eye(n)).logpdf(y)
            - np.sum(kff - np.diag(Q)) / (2 * s2))


def exact_lml(y, Kff, s2):
    return multivariate_normal(np.zeros(len(y)), Kff + s2 * np.eye(len(y))).logpdf(y)


def elbo_fn(model, guide):
    """The jitted closed-form ELBO ``(params, X, y) -> F`` (one compile per model and guide)."""
    elbo = svgp.InducingELBO()
    return jax.jit(lambda params, X, y: elbo.elbo(jax.random.key(0), params, model, guide, X, y))


def init_params(model, guide, X, y, seed=0):
    """The constrained parameters at ``SVI.init``."""
    import optax
    from numpyro.infer import SVI

    svi = SVI(model, guide, optax.sgd(0.0), svgp.InducingELBO())
    return svi.get_params(svi.init(jax.random.key(seed), X, y))
