"""RNVGP (thesis Ch. 3): the guide of Eq. 3.8 trained with unbiased ``O(d T M^2)`` gradients.

``q(u) = N(K_uu mu, (K_uu^-1 + Sigma^-1)^-1)`` with ``Sigma`` diagonal: the family of
:class:`fedppl.guides.svgp.DiagGuide`, whose bound (Eq. 3.15) is Eq. 2.12. The difference is
numerical: :class:`RandomisedGaussian` builds the ELBO's two ``A^-1`` terms from the
``jax.custom_vjp`` estimators of :mod:`fedppl.algorithms.rnvgp` (Hutchinson probes, randomised CG
with Russian-roulette truncation), so a step never factorises an ``M x M`` matrix and
``jax.grad`` returns an unbiased estimate of the exact gradient, which any optax optimiser uses
as it would an exact one. The ELBO's *value* omits ``-log|K_uu + Sigma| / 2`` unless
``RandomisedConfig(exact_value=True)`` (it has no unbiased ``O(M^2)`` estimate). Prediction is
exact (one ``O(M^3)`` factorisation at the end).

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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpyro
from jax import Array
from numpyro.distributions import constraints

from fedppl.algorithms.rnvgp import RandomisedConfig, data_part, kl_part
from fedppl.guides.svgp import PreconditionedGaussian, points_prior
from fedppl.models import svgp

__all__ = ["RandomisedConfig", "RandomisedGaussian", "RNVGPGuide"]


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
