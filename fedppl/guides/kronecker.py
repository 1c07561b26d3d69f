"""Grid-structured guides over ``u``: Kronecker, Tucker (TVGP) and sums of Kronecker terms.

For inducing inputs on a full grid (:class:`fedppl.models.svgp.Grid`, ``m_l`` points on axis
``l``, ``M = prod m_l``) the prior is ``K_uu = ⊗ K_l`` and the data rows are ``k_i = ⊗ k_il``.
The covariance of every guide here is Kronecker (Eq. 2.14)::

    S = ⊗_l S_l,   S_l = K_l - K_l (K_l + Sigma_l)^-1 K_l,   Sigma_l diagonal > 0,

and the mean is ``K_uu alpha`` with ``alpha`` a Tucker tensor ``W x_1 U_1 ... x_p U_p`` (core
``W`` of ``q0^p`` entries, factors ``U_l (m_l, q0)``): :class:`TuckerGuide` (TVGP, Eq. 2.18);
``q0 = 1`` is the Kronecker mean ``alpha = ⊗ alpha_l`` of Eq. 2.14 (:class:`KroneckerGuide`,
the thesis's "Kronecker to within a scalar factor"). With ``a_il = k_il' K_l^-1 k_il``,
``c_il = k_il' (K_l + Sigma_l)^-1 k_il`` and ``t_l = tr((K_l + Sigma_l)^-1 K_l)`` the bound
(Eqs. 2.15, 2.19) is::

    F = sum_i [log N(y_i | mu_i, s2) - (ktilde_ii + prod_l (a_il - c_il)) / (2 s2)] - KL,
    mu_i = W x_l (k_il' U_l),    ktilde_ii = k_ii - prod_l a_il,
    2 KL = W' (⊗ U_l' K_l U_l) W - M (1 - prod_l (1 - t_l / m_l))
           + sum_l (M / m_l) (log|K_l + Sigma_l| - log|Sigma_l|),

at ``O(sum_l m_l^3 + b sum_l m_l^2)`` for the covariance part and ``O(p q0^(p+1) + sum_l m_l^2
q0 + b (sum_l m_l q0 + q0^p))`` for the mean: no ``M``-sized object is formed. ``a_il - c_il`` is
computed as ``(K_l^-1 k_il)' Sigma_l ((K_l + Sigma_l)^-1 k_il)`` and the two ``1 - prod`` terms
through ``log1p``/``expm1`` (:func:`fedppl.families.kronecker.one_minus_prod`).

:class:`SumKroneckerGuide` is Eqs. 2.16-2.17, ``R`` Kronecker terms averaged: mean
``(1/R) sum_r ⊗ K_l alpha_rl`` and covariance ``(1/R) sum_r ⊗ S_rl``. Its ``log|S|`` has no
product form; ``log|(1/R) sum_r S_r| >= (1/R) sum_r log|S_r|`` (concavity) gives the lower bound
used here. Its mean term is exact, ``(1/R^2) sum_rr' prod_l alpha_rl' K_l alpha_r'l`` (the thesis
writes the looser ``(1/R) sum_r prod_l alpha_rl' K_l alpha_rl``).

Prediction at ``x*`` (TVGP): mean ``W x_l (k_*l' U_l)``, variance ``k_** - prod_l a_*l +
prod_l (a_*l - c_*l)``, plus ``s2`` for ``y*`` (:func:`fedppl.models.svgp.predict`).

Example (a 4 x 4 grid; train with ``SVI(model, guide, optax.adam(0.05), InducingELBO())`` as
in :mod:`fedppl.models.svgp`)::

    >>> import jax, jax.numpy as jnp
    >>> from fedppl.models.svgp import Grid, InducingELBO, SparseGPRegression
    >>> X = jnp.stack([jnp.linspace(-1, 1, 8), jnp.linspace(1, -1, 8)], axis=1)
    >>> model = SparseGPRegression(Grid.over(X, 4))                  # M = 16
    >>> guide = TuckerGuide(model, rank=2)
    >>> params = {"log_lengthscale": jnp.zeros(2), "log_variance": jnp.zeros(()),
    ...           "log_noise": jnp.log(0.1), "q_core": jnp.zeros((2, 2)),
    ...           "q_factor_0": jnp.ones((4, 2)), "q_factor_1": jnp.ones((4, 2)),
    ...           "q_sigma_0": jnp.full(4, 1e8), "q_sigma_1": jnp.full(4, 1e8)}
    >>> elbo = jax.jit(lambda p: InducingELBO().elbo(jax.random.key(0), p, model, guide, X,
    ...                                              jnp.zeros(8)))
    >>> round(float(elbo(params)), 1)        # W = 0, Sigma -> infinity: q(u) = p(u), KL = 0
    -388.9
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpyro
import numpyro.distributions as dist
from jax import Array
from numpyro.distributions import constraints
from numpyro.distributions.kl import kl_divergence

from fedppl.families import kronecker as kr
from fedppl.models import svgp

__all__ = ["KronCovariance", "TuckerGaussian", "SumKroneckerGaussian", "TuckerGuide",
           "KroneckerGuide", "SumKroneckerGuide", "grid_prior"]


def grid_prior(model: svgp.SparseGPRegression, X: Array) -> svgp.GridPrior:
    """The model's ``p(u)`` on its grid at the shared hyperparameters."""
    if not isinstance(model.inducing, svgp.Grid):
        raise ValueError("Kronecker-structured guides need inducing points on a Grid")
    hyper = model.hyperparameters(X.shape[1])
    prior = model.prior(hyper, X.shape[1])
    assert isinstance(prior, svgp.GridPrior)
    return prior


class KronCovariance(NamedTuple):
    """``S = ⊗ S_l`` from the diagonals ``sigma_l``: ``chol(K_l + Sigma_l)`` and the
    per-dimension quantities of the bound."""

    sigmas: list[Array]
    chols: list[Array]          # chol(K_l + Sigma_l)

    @classmethod
    def of(cls, prior: svgp.GridPrior, sigmas: Sequence[Array]) -> KronCovariance:
        return cls(list(sigmas), [jnp.linalg.cholesky(K + jnp.diag(s))
                                  for K, s in zip(prior.factors, sigmas, strict=True)])

    def traces(self, prior: svgp.GridPrior) -> Array:
        """``t_l = tr((K_l + Sigma_l)^-1 K_l)``, shape ``(p,)``."""
        return jnp.stack([jnp.trace(jsl.cho_solve((C, True), K))
                          for C, K in zip(self.chols, prior.factors, strict=True)])

    def kl_part(self, prior: svgp.GridPrior) -> Array:
        """``2 KL`` without the mean term: ``-M (1 - prod(1 - t_l/m_l)) + log-determinants``."""
        M = float(kr.grid_size(prior.sizes))
        ratio = self.traces(prior) / jnp.asarray(prior.sizes, dtype=prior.factors[0].dtype)
        logdets = [2.0 * jnp.sum(jnp.log(jnp.diagonal(C))) - jnp.sum(jnp.log(s))
                   for C, s in zip(self.chols, self.sigmas, strict=True)]
        return -M * kr.one_minus_prod(ratio) + kr.kron_logdet(logdets, prior.sizes)

    def spread(self, prior: svgp.GridPrior, rows: Sequence[Array]) -> Array:
        """``prod_l (a_il - c_il) = k_i' K^-1 S K^-1 k_i`` for every point, ``(b,)``."""
        out = jnp.ones(rows[0].shape[0], dtype=rows[0].dtype)
        for L, C, s, r in zip(prior.chols, self.chols, self.sigmas, rows, strict=True):
            w = jsl.cho_solve((L, True), r.T)                     # K_l^-1 k_il
            z = jsl.cho_solve((C, True), r.T)                     # (K_l + Sigma_l)^-1 k_il
            out = out * jnp.maximum(jnp.sum(w * s[:, None] * z, axis=0), 0.0)
        return out

    def factor_covariances(self, prior: svgp.GridPrior) -> list[Array]:
        """``S_l = Sigma_l - Sigma_l (K_l + Sigma_l)^-1 Sigma_l`` (dense, ``m_l x m_l``)."""
        out = []
        for C, s in zip(self.chols, self.sigmas, strict=True):
            half = jsl.solve_triangular(C, jnp.diag(s), lower=True)
            S = jnp.diag(s) - half.T @ half
            out.append(0.5 * (S + S.T))
        return out


def _sqrt_psd(S: Array) -> Array:
    w, V = jnp.linalg.eigh(S)
    return V * jnp.sqrt(jnp.maximum(w, 0.0))


class _GridGaussian(dist.Distribution):
    """Shared shape, ``sample`` and ``log_prob`` of the grid guides (``O(M sum m_l)``; for
    Monte Carlo checks and numpyro's own ELBOs on grids that fit in memory)."""

    support = constraints.real_vector

    def __init__(self, prior: svgp.GridPrior):
        self.prior = prior
        super().__init__(batch_shape=(), event_shape=(kr.grid_size(prior.sizes),))

    @property
    def mean(self) -> Array:
        raise NotImplementedError

    def _terms(self) -> list[tuple[Array, list[Array]]]:
        """``(weight, [S_l])`` of the covariance ``sum_r weight_r ⊗ S_rl``."""
        raise NotImplementedError

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        M = self.event_shape[0]
        n = int(jnp.prod(jnp.asarray(sample_shape))) if sample_shape else 1
        terms = self._terms()
        keys = jax.random.split(key, len(terms))
        out = jnp.broadcast_to(self.mean, (n, M))
        for k, (wgt, S) in zip(keys, terms, strict=True):
            roots = [_sqrt_psd(s) for s in S]
            eps = jax.random.normal(k, (n, M))
            out = out + jnp.sqrt(wgt) * jax.vmap(lambda e, r=roots: kr.kron_matvec(r, e))(eps)
        return out.reshape(*sample_shape, M)

    def log_prob(self, value: Array) -> Array:
        cov = sum(w * kr.kron_dense(S) for w, S in self._terms())   # small grids only
        return dist.MultivariateNormal(self.mean, covariance_matrix=cov).log_prob(value)


class TuckerGaussian(_GridGaussian):
    """``q(u) = N(K_uu (W x_l U_l), ⊗ S_l)`` (Eq. 2.18): core ``W`` (``q0^p`` entries, any
    shape), factors ``U_l (m_l, q0)``, covariance ``cov``."""

    def __init__(self, prior: svgp.GridPrior, core: Array, factors: Sequence[Array],
                 cov: KronCovariance):
        self.core, self.factors, self.cov = core, list(factors), cov
        super().__init__(prior)

    @property
    def mean(self) -> Array:
        """``K_uu alpha = W x_l (K_l U_l)`` (the Tucker-Kronecker identity, Eq. 2.21)."""
        return kr.kron_matvec([K @ U for K, U in zip(self.prior.factors, self.factors,
                                                     strict=True)], self.core)

    def _terms(self) -> list[tuple[Array, list[Array]]]:
        return [(jnp.ones(()), self.cov.factor_covariances(self.prior))]

    def moments(self, X: Array) -> tuple[Array, Array]:
        rows = self.prior.cross(X)
        mean = kr.contract_rows(self.core, [r @ U for r, U in zip(rows, self.factors,
                                                                  strict=True)])
        return mean, self.prior.ktilde(X, rows) + self.cov.spread(self.prior, rows)


@svgp.expected_log_likelihood.register
def _(q: TuckerGaussian, lik: svgp.InducingLikelihood, y: Array) -> Array:
    mean, var = q.moments(lik.X)
    return svgp.gaussian_terms(y, mean, var, lik.noise)


@svgp.inducing_kl.register
def _(q: TuckerGaussian, p: Any) -> Array:
    grams = [U.T @ K @ U for U, K in zip(q.factors, q.prior.factors, strict=True)]
    return 0.5 * (kr.tucker_quadratic(q.core, grams) + q.cov.kl_part(q.prior))


@svgp.predict_latent.register
def _(q: TuckerGaussian, prior: Any, X: Array) -> tuple[Array, Array]:
    return q.moments(X)


@kl_divergence.register(TuckerGaussian, svgp.GridPrior)
def _kl_tucker(q: TuckerGaussian, p: svgp.GridPrior) -> Array:
    return svgp.inducing_kl(q, p)


class SumKroneckerGaussian(_GridGaussian):
    """``q(u) = N((1/R) sum_r ⊗ K_l alpha_rl, (1/R) sum_r ⊗ S_rl)`` (Eq. 2.16): ``alphas[l]`` and
    the covariances' diagonals are ``(R, m_l)`` per dimension."""

    def __init__(self, prior: svgp.GridPrior, alphas: Sequence[Array],
                 covs: Sequence[KronCovariance]):
        self.alphas, self.covs = list(alphas), list(covs)
        super().__init__(prior)

    @property
    def num_terms(self) -> int:
        return len(self.covs)

    @property
    def mean(self) -> Array:
        Ka = [a @ K for a, K in zip(self.alphas, self.prior.factors, strict=True)]  # (R, m_l)
        return jnp.mean(jnp.stack([kr.kron_vectors([k[r] for k in Ka])
                                   for r in range(self.num_terms)]), axis=0)

    def _terms(self) -> list[tuple[Array, list[Array]]]:
        w = jnp.asarray(1.0 / self.num_terms)
        return [(w, c.factor_covariances(self.prior)) for c in self.covs]

    def moments(self, X: Array) -> tuple[Array, Array]:
        rows = self.prior.cross(X)
        per_term = jnp.prod(jnp.stack([r @ a.T for r, a in zip(rows, self.alphas, strict=True)]),
                            axis=0)                                        # (b, R)
        spread = jnp.mean(jnp.stack([c.spread(self.prior, rows) for c in self.covs]), axis=0)
        return jnp.mean(per_term, axis=1), self.prior.ktilde(X, rows) + spread


@svgp.expected_log_likelihood.register
def _(q: SumKroneckerGaussian, lik: svgp.InducingLikelihood, y: Array) -> Array:
    mean, var = q.moments(lik.X)
    return svgp.gaussian_terms(y, mean, var, lik.noise)


@svgp.inducing_kl.register
def _(q: SumKroneckerGaussian, p: Any) -> Array:
    """An upper bound on the KL (Jensen on ``log|S|``); exact for one term."""
    gram = jnp.prod(jnp.stack([a @ K @ a.T for a, K in zip(q.alphas, q.prior.factors,
                                                           strict=True)]), axis=0)  # (R, R)
    mean_term = jnp.sum(gram) / q.num_terms**2
    cov_term = jnp.mean(jnp.stack([c.kl_part(q.prior) for c in q.covs]))
    return 0.5 * (mean_term + cov_term)


@svgp.predict_latent.register
def _(q: SumKroneckerGaussian, prior: Any, X: Array) -> tuple[Array, Array]:
    return q.moments(X)


def _check_rank(rank: int, sizes: Sequence[int]) -> None:
    if int(rank) < 1 or int(rank) > min(sizes):
        raise ValueError(f"Tucker rank q0 must be in 1..min(m0) = 1..{min(sizes)} (q0 <= m0), "
                         f"got {rank}")


class TuckerGuide:
    """TVGP (Eq. 2.18): Tucker mean of rank ``q0`` (params ``q_core`` ``(q0,)*p``,
    ``q_factor_l`` ``(m_l, q0)``), Kronecker covariance (``q_sigma_l`` ``(m_l,)``).

    Starts at ``W = 0`` (so ``q(u)`` has zero mean and the gradient moves the core first),
    ``U_l`` with ``N(0, 1 / m_l)`` entries and ``Sigma_l = sigma I``."""

    def __init__(self, model: svgp.SparseGPRegression, rank: int, sigma: float = 1.0,
                 core_scale: float = 0.0):
        if not isinstance(model.inducing, svgp.Grid):
            raise ValueError("Kronecker-structured guides need inducing points on a Grid")
        _check_rank(rank, model.inducing.sizes)
        self.model, self.rank, self.sigma, self.core_scale = model, int(rank), sigma, core_scale

    def _core(self, p: int) -> Array:
        shape = (self.rank,) * p
        return numpyro.param("q_core", lambda key: self.core_scale * jax.random.normal(key, shape))

    def __call__(self, X: Array, y: Array | None = None) -> None:
        prior = grid_prior(self.model, X)
        factors, sigmas = [], []
        for l, m in enumerate(prior.sizes):
            factors.append(numpyro.param(
                f"q_factor_{l}", lambda key, m=m: jax.random.normal(key, (m, self.rank)) / m**0.5))
            sigmas.append(numpyro.param(f"q_sigma_{l}", jnp.full(m, self.sigma),
                                        constraint=constraints.positive))
        core = self._core(len(prior.sizes))
        numpyro.sample("u", TuckerGaussian(prior, core, factors, KronCovariance.of(prior, sigmas)))


class KroneckerGuide(TuckerGuide):
    """The Kronecker guide of Eq. 2.14: TVGP with ``q0 = 1``, ``alpha = W (U_1 ⊗ ... ⊗ U_p)``
    with one scalar ``W`` (redundant with the factors' scale, but it lets the mean start at zero
    without the saddle point that ``alpha_l = 0`` is for a product)."""

    def __init__(self, model: svgp.SparseGPRegression, sigma: float = 1.0):
        super().__init__(model, rank=1, sigma=sigma)


class SumKroneckerGuide:
    """Eqs. 2.16-2.17: ``terms`` Kronecker terms (params ``q_alpha_l`` ``(R, m_l)`` with
    ``N(0, 1 / m_l)`` entries, ``q_sigma_l`` ``(R, m_l)``)."""

    def __init__(self, model: svgp.SparseGPRegression, terms: int, sigma: float = 1.0):
        if not isinstance(model.inducing, svgp.Grid):
            raise ValueError("Kronecker-structured guides need inducing points on a Grid")
        if int(terms) < 1:
            raise ValueError(f"terms must be a positive integer, got {terms}")
        self.model, self.terms, self.sigma = model, int(terms), sigma

    def __call__(self, X: Array, y: Array | None = None) -> None:
        prior = grid_prior(self.model, X)
        R = self.terms
        alphas, sigmas = [], []
        for l, m in enumerate(prior.sizes):
            alphas.append(numpyro.param(
                f"q_alpha_{l}", lambda key, m=m: jax.random.normal(key, (R, m)) / m**0.5))
            sigmas.append(numpyro.param(f"q_sigma_{l}", jnp.full((R, m), self.sigma),
                                        constraint=constraints.positive))
        covs = [KronCovariance.of(prior, [s[r] for s in sigmas]) for r in range(R)]
        numpyro.sample("u", SumKroneckerGaussian(prior, alphas, covs))
