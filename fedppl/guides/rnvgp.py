"""RNVGP (thesis chapter 3): the guide of Eq. 3.8 trained with unbiased ``O(d T M^2)`` gradients.

``q(u) = N(K_uu mu, (K_uu^-1 + Sigma^-1)^-1)`` with ``Sigma`` diagonal: the family of
:class:`fedppl.guides.svgp.DiagGuide`, whose bound (Eq. 3.15) is Eq. 2.12. The difference is
numerical: :class:`RandomisedGaussian` builds the ELBO's two ``A^-1`` terms from the
``jax.custom_vjp`` estimators below (Hutchinson probes, randomised CG with Russian-roulette
truncation), so a step never factorises an ``M x M`` matrix and ``jax.grad`` returns an unbiased
estimate of the exact gradient, which any optax optimiser uses as it would an exact one. The
ELBO's *value* omits ``-log|K_uu + Sigma| / 2`` unless ``RandomisedConfig(exact_value=True)`` (it
has no unbiased ``O(M^2)`` estimate). Prediction is exact (one ``O(M^3)`` factorisation at the
end).

Example (train with ``SVI(model, guide, optax.adagrad(0.1), InducingELBO())``; here one
gradient, which differs from draw to draw)::

    >>> import jax, jax.numpy as jnp
    >>> from fedppl.models.svgp import InducingELBO, Points, SparseGPRegression
    >>> X = jnp.linspace(-2.0, 2.0, 6)[:, None]
    >>> model = SparseGPRegression(Points(X, learn=False))
    >>> guide = RNVGPGuide(model, RandomisedConfig(probes=2))
    >>> params = {"log_lengthscale": jnp.zeros(1), "log_variance": jnp.zeros(()),
    ...           "log_noise": jnp.log(0.1), "q_mu": jnp.zeros(6), "q_sigma": jnp.ones(6)}
    >>> grad = jax.jit(jax.grad(lambda p, k: InducingELBO().elbo(k, p, model, guide, X, X[:, 0])))
    >>> g1, g2 = grad(params, jax.random.key(1)), grad(params, jax.random.key(2))
    >>> bool(g1["q_mu"].shape == (6,) and jnp.any(g1["q_sigma"] != g2["q_sigma"]))
    True

The estimators: randomised numerics for the (alpha, Sigma) bound, unbiased gradient estimates
in ``O(d T M^2)``, with ``d`` probes and ``T`` conjugate-gradient iterations.

The bound of Eq. 3.15 (the family of Eq. 2.8 with mean ``K mu``), ``A = K + Sigma``, has two
parts whose exact gradients need ``A^-1`` (``O(M^3)``); everything else is ``O(M^2)`` and left to
ordinary autodiff:

* :func:`kl_part` ``= -tr(A^-1 K) / 2 + log|A| / 2`` (in ``KL(q || p)``), with
  ``d/dK = A^-1 K A^-1 / 2`` and ``d/dSigma = diag(A^-1 K A^-1 + A^-1) / 2``;
* :func:`data_part` ``= diag(B A^-1 B') / 2`` per point, ``B = K_bu / s`` (in the expected
  log-likelihood), with ``d/dB = diag(g) B A^-1`` and ``d/dK = d/dSigma =
  -A^-1 B' diag(g) B A^-1 / 2`` for the incoming cotangent ``g``.

Both are ``jax.custom_vjp`` functions whose backward pass returns unbiased estimates, so
``jax.grad`` of a loss built from them (and optax on top) sees an ordinary gradient whose
expectation is the exact one; the chain rule then carries ``d/dK`` and ``d/dB`` to the kernel
hyperparameters and inducing inputs (Eq. 3.16). The estimators (Filippone & Engler, 2015):

* Hutchinson probes ``r_k`` (Rademacher or Gaussian, ``E[r r'] = I``):
  ``A^-1 C A^-1 = E[(A^-1 C r)(A^-1 r)']`` and ``diag(A^-1) = E[(A^-1 r) ⊙ r]``;
* :func:`unbiased_cg`: conjugate gradients run until the relative residual is below
  ``tol_first`` (the first ``L`` terms of the CG series), then extended by Russian roulette:
  the ``j``-th further term (``j = 0, 1, ...``) is computed with probability
  ``exp(-roulette * j)`` given the previous one and weighted by the inverse of the probability
  of reaching it, ``exp(roulette * j (j + 1) / 2)``; the series ends at relative residual
  ``tol`` (after which every CG term is zero). Its expectation is the ``tol``-converged CG
  solution. The two solves in each product use independent roulette draws, so the product's
  expectation is the product of the expectations.

``log|A|`` has no unbiased ``O(M^2)`` estimator, so the forward value of :func:`kl_part` leaves it
out (``exact_value=False``: the value is a Hutchinson estimate of ``-tr(A^-1 K) / 2`` only) or
computes the whole part by Cholesky (``exact_value=True``, ``O(M^3)``, for monitoring).

Example (the unbiased CG solve)::

    >>> import jax, jax.numpy as jnp
    >>> A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
    >>> b = jnp.array([1.0, 2.0])
    >>> cfg = RandomisedConfig(tol_first=0.5, tol=1e-6)
    >>> keys = jax.random.split(jax.random.key(0), 4000)
    >>> xs = jax.vmap(lambda k: unbiased_cg(A, b, k, cfg)[0])(keys)
    >>> bool(jnp.allclose(xs.mean(0), jnp.linalg.solve(A, b), atol=0.02))
    True
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpyro
from jax import Array
from numpyro.distributions import constraints

from fedppl.guides.svgp import PreconditionedGaussian, points_prior
from fedppl.models import svgp

__all__ = ["RandomisedConfig", "RandomisedGaussian", "RNVGPGuide", "unbiased_cg", "probes",
           "kl_part", "data_part"]


# -- the estimators --------------------------------------------------------------------------------


class RandomisedConfig(NamedTuple):
    """Settings of the estimators: ``probes`` (``d``), CG tolerances ``tol_first``
    (``epsilon_L``) and ``tol`` (``epsilon``), the roulette rate ``roulette`` (``beta``),
    ``max_iter`` (CG steps per solve; ``None``: ``2 M``), the probe distribution, and whether the
    forward value of :func:`kl_part` is exact (``O(M^3)``)."""

    probes: int = 5
    tol_first: float = 1e-3
    tol: float = 1e-6
    roulette: float = 0.1
    max_iter: int | None = None
    probe: str = "rademacher"
    exact_value: bool = False

    def check(self) -> RandomisedConfig:
        if self.probes < 1:
            raise ValueError(f"probes must be a positive integer, got {self.probes}")
        if not 0 < self.tol <= self.tol_first:
            raise ValueError(f"need 0 < tol <= tol_first, got tol={self.tol}, "
                             f"tol_first={self.tol_first}")
        if self.roulette < 0:
            raise ValueError(f"roulette (beta) must be >= 0, got {self.roulette}")
        if self.probe not in ("rademacher", "gaussian"):
            raise ValueError(f"probe must be 'rademacher' or 'gaussian', got {self.probe!r}")
        return self


class _CG(NamedTuple):
    i: Array           # iterations done
    x: Array           # the weighted sum of CG increments so far
    r: Array           # CG residual
    p: Array           # CG direction
    rs: Array          # r'r
    weight: Array      # weight of the next increment
    j: Array           # index of the next roulette term (-1: still in the first L terms)
    done: Array


def unbiased_cg(A: Array, b: Array, key: Array, config: RandomisedConfig) -> tuple[Array, Array]:
    """An unbiased estimate of the ``tol``-converged CG solution of ``A x = b`` (``A`` symmetric
    positive definite, dense); returns ``(x, iterations)``. ``O(T M^2)``."""
    max_iter = 2 * A.shape[0] if config.max_iter is None else int(config.max_iter)
    bnorm = jnp.sqrt(b @ b)
    beta = config.roulette

    def body(s: _CG) -> _CG:
        Ap = A @ s.p
        a = s.rs / (s.p @ Ap)
        x = s.x + s.weight * a * s.p
        r = s.r - a * Ap
        rs = r @ r
        res = jnp.sqrt(rs)
        j = jnp.where(s.j >= 0, s.j + 1, jnp.where(res < config.tol_first * bnorm, 0, -1))
        survive = jax.random.uniform(jax.random.fold_in(key, s.i)) < jnp.exp(-beta * j)
        weight = jnp.where(j > 0, s.weight * jnp.exp(beta * j), s.weight)
        done = (res <= config.tol * bnorm) | ((j >= 0) & ~survive)
        return _CG(s.i + 1, x, r, r + (rs / s.rs) * s.p, rs, weight, j, done)

    zero = jnp.zeros_like(b)
    rs0 = b @ b
    init = _CG(jnp.asarray(0), zero, b, b, rs0, jnp.ones((), b.dtype), jnp.asarray(-1),
               jnp.sqrt(rs0) <= config.tol * bnorm)
    out = jax.lax.while_loop(lambda s: ~s.done & (s.i < max_iter), body, init)
    return out.x, out.i


def _solve_many(A: Array, B: Array, key: Array, config: RandomisedConfig) -> Array:
    """Unbiased CG solves for the columns of ``B (M, k)``, independent roulette per column."""
    keys = jax.random.split(key, B.shape[1])
    xs, _ = jax.vmap(lambda b, k: unbiased_cg(A, b, k, config), in_axes=(1, 0))(B, keys)
    return xs.T


def probes(key: Array, size: int, config: RandomisedConfig, dtype: Any = float) -> Array:
    """``(size, d)`` probe vectors with ``E[r r'] = I``."""
    shape = (size, config.probes)
    if config.probe == "gaussian":
        return jax.random.normal(key, shape, dtype)
    return jax.random.rademacher(key, shape, dtype)


def _sym_outer(Z: Array, X: Array) -> Array:
    """``(Z X' + X Z') / (2 d)``: the symmetrised mean of ``d`` outer products."""
    P = Z @ X.T / X.shape[1]
    return 0.5 * (P + P.T)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def kl_part(K: Array, sigma: Array, key: Array, config: RandomisedConfig) -> Array:
    """``-tr(A^-1 K) / 2 + log|A| / 2`` (``A = K + diag(sigma)``); see the module doc for the
    forward value and the gradient estimator."""
    return _kl_fwd(K, sigma, key, config)[0]


def _kl_fwd(K: Array, sigma: Array, key: Array, config: RandomisedConfig):
    A = K + jnp.diag(sigma)
    k_probe, k_solve = jax.random.split(jax.random.fold_in(key, 0))
    R = probes(k_probe, K.shape[0], config, K.dtype)
    X = _solve_many(A, R, k_solve, config)                 # A^-1 r
    if config.exact_value:
        L = jnp.linalg.cholesky(A)
        value = 0.5 * (2.0 * jnp.sum(jnp.log(jnp.diagonal(L)))
                       - jnp.trace(jax.scipy.linalg.cho_solve((L, True), K)))
    else:
        value = -0.5 * jnp.mean(jnp.sum(X * (K @ R), axis=0))
    return value, (A, K, R, X, key)


def _kl_bwd(config: RandomisedConfig, res, g):
    A, K, R, X, key = res
    Z = _solve_many(A, K @ R, jax.random.fold_in(key, 1), config)   # A^-1 K r, own roulette
    dK = 0.5 * _sym_outer(Z, X)
    dsigma = 0.5 * jnp.mean(Z * X + X * R, axis=1)
    return g * dK, g * dsigma, None


kl_part.defvjp(_kl_fwd, _kl_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def data_part(B: Array, K: Array, sigma: Array, key: Array, config: RandomisedConfig) -> Array:
    """``diag(B A^-1 B') / 2`` per row of ``B (b, M)`` (``A = K + diag(sigma)``), estimated
    without bias; see the module doc."""
    return _data_fwd(B, K, sigma, key, config)[0]


def _data_fwd(B: Array, K: Array, sigma: Array, key: Array, config: RandomisedConfig):
    A = K + jnp.diag(sigma)
    k_probe, k_solve = jax.random.split(jax.random.fold_in(key, 2))
    R = probes(k_probe, K.shape[0], config, K.dtype)
    X = _solve_many(A, R, k_solve, config)
    value = 0.5 * jnp.mean((B @ X) * (B @ R), axis=1)
    return value, (A, B, R, X, key)


def _data_bwd(config: RandomisedConfig, res, g):
    A, B, R, X, key = res
    Z = _solve_many(A, B.T @ (g[:, None] * (B @ R)), jax.random.fold_in(key, 3), config)
    dB = (g[:, None] * (B @ X)) @ R.T / R.shape[1]     # diag(g) B A^-1
    dA = -0.5 * _sym_outer(Z, X)                        # -A^-1 B' diag(g) B A^-1 / 2
    return dB, dA, jnp.diagonal(dA), None


data_part.defvjp(_data_fwd, _data_bwd)


# -- the guide -------------------------------------------------------------------------------------


class RandomisedGaussian(PreconditionedGaussian):
    """:class:`PreconditionedGaussian` (``alpha = mu``) whose KL and expected log-likelihood use
    the randomised estimators with ``key`` (split between them) and ``config``."""

    def __init__(self, prior: svgp.PointsPrior, mu: Array, sigma: Array, key: Array,
                 config: RandomisedConfig):
        super().__init__(prior, mu, sigma)
        self.key, self.config = key, config


@svgp.expected_log_likelihood.register
def _(q: RandomisedGaussian, lik: svgp.InducingLikelihood, y: Array) -> Array:
    Kxu = q.prior.cross(lik.X)
    s2 = lik.noise**2
    fit = -0.5 * jnp.log(2 * jnp.pi * s2) - 0.5 * (y - Kxu @ q.alpha) ** 2 / s2
    return (fit - 0.5 * q.prior.hyper.variance / s2
            + data_part(Kxu / lik.noise, q.prior.K, q.sigma, jax.random.fold_in(q.key, 1),
                        q.config))


@svgp.inducing_kl.register
def _(q: RandomisedGaussian, p: Any) -> Array:
    K = q.prior.K
    return (0.5 * q.alpha @ K @ q.alpha - 0.5 * jnp.sum(jnp.log(q.sigma))
            + kl_part(K, q.sigma, jax.random.fold_in(q.key, 0), q.config))


class RNVGPGuide:
    """RNVGP (params ``q_mu``, ``q_sigma``; starts at ``mu = 0``, ``Sigma = sigma I``); each call
    draws a fresh key (``numpyro.prng_key``) for the probes and the roulette."""

    def __init__(self, model: svgp.SparseGPRegression, config: RandomisedConfig | None = None,
                 sigma: float = 1.0):
        self.model, self.sigma = model, sigma
        self.config = (config or RandomisedConfig()).check()

    def __call__(self, X: Array, y: Array | None = None) -> None:
        svgp.require_float64(X, "RNVGPGuide", "its randomised conjugate gradients stop at "
                             "tolerances float32 cannot reach, so the unbiased estimates of the "
                             "bound and its gradients are dominated by rounding")
        prior = points_prior(self.model, X)
        M = prior.event_shape[0]
        mu = numpyro.param("q_mu", jnp.zeros(M))
        sigma = numpyro.param("q_sigma", jnp.full(M, self.sigma), constraint=constraints.positive)
        key = numpyro.prng_key()
        if key is None:                      # traced without a seed (e.g. shape inference)
            key = jax.random.key(0)
        numpyro.sample("u", RandomisedGaussian(prior, mu, sigma, key, self.config))
