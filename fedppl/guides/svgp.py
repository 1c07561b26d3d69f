"""Dense guides over the inducing values ``u`` of :class:`fedppl.models.svgp.SparseGPRegression`.

* :class:`SVIGPGuide`: Hensman et al.'s ``q(u) = N(m, S)`` with a full ``S`` (the thesis's
  baseline), as numpyro's ``MultivariateNormal``; by default whitened (``m = L m_w``,
  ``S = L S_w L'`` with ``K_uu = L L'``), the same family in better coordinates. ``O(M^3)``.
* :class:`DiagGuide`: the family of Eq. 2.8, ``q(u) = N(K_uu alpha, K_uu - K_uu (K_uu +
  Sigma)^-1 K_uu)`` with ``Sigma`` diagonal (``2M`` parameters), as
  :class:`PreconditionedGaussian`. Its ELBO is Eq. 2.12::

      F = sum_i [log N(y_i | k_i' alpha, s2) - (k_ii - k_i' A^-1 k_i) / (2 s2)]
          - [alpha' K alpha - tr(A^-1 K) - log|Sigma| + log|A|] / 2,     A = K_uu + Sigma,

  the first line the expected log-likelihood, the second ``-KL(q || p)``. ``K_uu^-1`` never
  appears (it cancels), which is what lets RNVGP (:mod:`fedppl.guides.rnvgp`) estimate the
  gradients with solves in the well-conditioned ``A`` only.

Example::

    >>> import jax, jax.numpy as jnp
    >>> from fedppl.models.svgp import SparseGPRegression, Points, InducingELBO
    >>> X = jnp.linspace(-1.0, 1.0, 8)[:, None]
    >>> model = SparseGPRegression(Points(X[::2], learn=False))
    >>> guide = DiagGuide(model)
    >>> params = {"q_alpha": jnp.zeros(4), "q_sigma": jnp.full(4, 1e6), "log_lengthscale":
    ...           jnp.zeros(1), "log_variance": jnp.zeros(()), "log_noise": jnp.log(0.1)}
    >>> elbo = jax.jit(lambda p: InducingELBO().elbo(jax.random.key(0), p, model, guide, X,
    ...                                              jnp.zeros(8)))
    >>> round(float(elbo(params)), 1)  # Sigma -> inf, alpha = 0: q = p; 8 log N(0|0, s2) - 8 / 2s2
    -388.9
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpyro
import numpyro.distributions as dist
from jax import Array
from numpyro.distributions import constraints
from numpyro.distributions.kl import kl_divergence

from fedppl.models import svgp

__all__ = ["SVIGPGuide", "WhitenedGaussian", "DiagGuide", "PreconditionedGaussian", "points_prior",
           "optimal_alpha"]


def points_prior(model: svgp.SparseGPRegression, X: Array) -> svgp.PointsPrior:
    """The model's ``p(u)`` at its (shared) hyperparameters; dense guides need inducing points."""
    if not isinstance(model.inducing, svgp.Points):
        raise ValueError("this guide needs inducing Points (a dense K_uu); use the Kronecker or "
                         "Tucker guides of fedppl.guides.kronecker for a Grid")
    hyper = model.hyperparameters(X.shape[1])
    prior = model.prior(hyper, X.shape[1])
    assert isinstance(prior, svgp.PointsPrior)
    return prior


class WhitenedGaussian(dist.MultivariateNormal):
    """``q(u) = N(L m_w, L S_w L')`` with ``K_uu = L L'`` and ``S_w = L_w L_w'``: numpyro's
    ``MultivariateNormal`` (for drawing and densities) whose KL and expected log-likelihood use
    the whitened forms, ``2 KL = |L_w|_F^2 + |m_w|^2 - M - log|S_w|`` and
    ``Var f_i = ktilde_ii + |L_w' L^-1 k_i|^2`` (one ``O(M^3 / 3)`` Cholesky of ``K_uu``, the rest
    ``O(b M^2)``; the ``L L_w`` product of the base class is left unused, and compiled away)."""

    def __init__(self, prior: svgp.PointsPrior, m_w: Array, L_w: Array):
        self.prior, self.m_w, self.L_w = prior, m_w, L_w
        super().__init__(prior.scale_tril @ m_w, scale_tril=prior.scale_tril @ L_w)

    def moments(self, X: Array) -> tuple[Array, Array]:
        W = jsl.solve_triangular(self.prior.scale_tril, self.prior.cross(X).T, lower=True)
        ktilde = jnp.maximum(self.prior.hyper.variance - jnp.sum(W**2, axis=0), 0.0)
        return W.T @ self.m_w, ktilde + jnp.sum((self.L_w.T @ W) ** 2, axis=0)


@svgp.expected_log_likelihood.register
def _(q: WhitenedGaussian, lik: svgp.InducingLikelihood, y: Array) -> Array:
    mean, var = q.moments(lik.X)
    return svgp.gaussian_terms(y, mean, var, lik.noise)


@svgp.inducing_kl.register
def _(q: WhitenedGaussian, p: Any) -> Array:
    logdet = 2.0 * jnp.sum(jnp.log(jnp.abs(jnp.diagonal(q.L_w))))
    return 0.5 * (jnp.sum(q.L_w**2) + q.m_w @ q.m_w - q.m_w.shape[0] - logdet)


@svgp.predict_latent.register
def _(q: WhitenedGaussian, prior: Any, X: Array) -> tuple[Array, Array]:
    return q.moments(X)


# measured (tests/float32/test_methods_float32.py): at float64's optimum (20 learnt inducing
# points) its float32 ELBO is 84 nats off, and its gradients are mostly rounding
_SVIGP_FLOAT32 = ("its full S in whitened coordinates, over learnt inducing points close "
                  "together, is not resolved in float32 (the bound at float64's optimum comes "
                  "out tens of nats off); DiagGuide and the Kronecker guides run in float32")


class SVIGPGuide:
    """``q(u) = N(m, S)``, full ``S`` (params ``q_mean``, ``q_scale_tril``); ``whiten`` reads
    them in the coordinates ``v = L^-1 u`` (:class:`WhitenedGaussian`), otherwise they are
    ``m`` and ``chol(S)`` (numpyro's ``MultivariateNormal``). Starts at ``m = 0``,
    ``S_w = init_scale^2 I``."""

    def __init__(self, model: svgp.SparseGPRegression, whiten: bool = True,
                 init_scale: float = 1.0):
        self.model, self.whiten, self.init_scale = model, whiten, init_scale

    def __call__(self, X: Array, y: Array | None = None) -> None:
        svgp.require_float64(X, "SVIGPGuide", _SVIGP_FLOAT32)
        prior = points_prior(self.model, X)
        M = prior.event_shape[0]
        m = numpyro.param("q_mean", jnp.zeros(M))
        tril = numpyro.param("q_scale_tril", self.init_scale * jnp.eye(M),
                             constraint=constraints.lower_cholesky)
        q = (WhitenedGaussian(prior, m, tril) if self.whiten
             else dist.MultivariateNormal(m, scale_tril=tril))
        numpyro.sample("u", q)


class PreconditionedGaussian(dist.Distribution):
    """``q(u) = N(K alpha, K - K (K + Sigma)^-1 K)`` (Eq. 2.8), ``K`` the prior's ``K_uu`` and
    ``sigma`` the diagonal of ``Sigma``. ``chol_A`` (``A = K + Sigma``) is computed on first use,
    so estimators that never factorise ``A`` (RNVGP) never pay for it."""

    support = constraints.real_vector

    def __init__(self, prior: svgp.PointsPrior, alpha: Array, sigma: Array):
        self.prior, self.alpha, self.sigma = prior, alpha, sigma
        self._chol_A: Array | None = None
        super().__init__(batch_shape=(), event_shape=(alpha.shape[0],))

    @property
    def A(self) -> Array:
        return self.prior.K + jnp.diag(self.sigma)

    @property
    def chol_A(self) -> Array:
        if self._chol_A is None:
            self._chol_A = jnp.linalg.cholesky(self.A)
        return self._chol_A

    @property
    def mean(self) -> Array:
        return self.prior.K @ self.alpha

    @property
    def covariance_matrix(self) -> Array:
        """``Sigma - Sigma A^-1 Sigma`` (= ``K - K A^-1 K``), formed densely."""
        half = jsl.solve_triangular(self.chol_A, jnp.diag(self.sigma), lower=True)
        S = jnp.diag(self.sigma) - half.T @ half
        return 0.5 * (S + S.T)

    def _mvn(self) -> dist.MultivariateNormal:
        return dist.MultivariateNormal(self.mean, covariance_matrix=self.covariance_matrix)

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        return self._mvn().sample(key, sample_shape)

    def log_prob(self, value: Array) -> Array:
        return self._mvn().log_prob(value)


def _diag_moments(q: PreconditionedGaussian, X: Array) -> tuple[Array, Array]:
    Kxu = q.prior.cross(X)
    half = jsl.solve_triangular(q.chol_A, Kxu.T, lower=True)
    return Kxu @ q.alpha, jnp.maximum(q.prior.hyper.variance - jnp.sum(half**2, axis=0), 0.0)


@svgp.expected_log_likelihood.register
def _(q: PreconditionedGaussian, lik: svgp.InducingLikelihood, y: Array) -> Array:
    mean, var = _diag_moments(q, lik.X)
    return svgp.gaussian_terms(y, mean, var, lik.noise)


@svgp.inducing_kl.register
def _(q: PreconditionedGaussian, p: Any) -> Array:
    K, L = q.prior.K, q.chol_A
    Linv = jsl.solve_triangular(L, jnp.eye(K.shape[0], dtype=K.dtype), lower=True)
    trace = K.shape[0] - jnp.sum(q.sigma * jnp.sum(Linv**2, axis=0))  # M - tr(A^-1 Sigma)
    logdet_A = 2.0 * jnp.sum(jnp.log(jnp.diagonal(L)))
    quad = q.alpha @ K @ q.alpha
    return 0.5 * (quad - trace - jnp.sum(jnp.log(q.sigma)) + logdet_A)


@svgp.predict_latent.register
def _(q: PreconditionedGaussian, prior: Any, X: Array) -> tuple[Array, Array]:
    return _diag_moments(q, X)


@kl_divergence.register(PreconditionedGaussian, svgp.PointsPrior)
def _kl_preconditioned(q: PreconditionedGaussian, p: svgp.PointsPrior) -> Array:
    return svgp.inducing_kl(q, p)


class DiagGuide:
    """The (alpha, diagonal Sigma) guide of Eq. 2.8 (params ``q_alpha``, ``q_sigma``); starts at
    ``alpha = 0`` and ``Sigma = sigma I``."""

    def __init__(self, model: svgp.SparseGPRegression, sigma: float = 1.0):
        self.model, self.sigma = model, sigma

    def __call__(self, X: Array, y: Array | None = None) -> None:
        prior = points_prior(self.model, X)
        M = prior.event_shape[0]
        alpha = numpyro.param("q_alpha", jnp.zeros(M))
        sigma = numpyro.param("q_sigma", jnp.full(M, self.sigma), constraint=constraints.positive)
        numpyro.sample("u", PreconditionedGaussian(prior, alpha, sigma))


def optimal_alpha(prior: svgp.PointsPrior, X: Array, y: Array, sigma: Array, noise: Array
                  ) -> Array:
    """The maximiser of Eq. 2.12 in ``alpha`` for fixed ``Sigma``:
    ``(K_uf K_fu / s2 + K_uu)^-1 K_uf y / s2`` (a quadratic in ``alpha``)."""
    Kfu = prior.cross(X)
    P = Kfu.T @ Kfu / noise**2 + prior.K
    return jnp.linalg.solve(P, Kfu.T @ y / noise**2)

