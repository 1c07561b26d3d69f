"""Multi-class classification made Polya-Gamma conjugate by the one-vs-each (OVE) bound.

The softmax ``p(y = k | f) = exp(f_k) / sum_j exp(f_j)`` admits no Polya-Gamma augmentation, but
the one-vs-each likelihood (Titsias 2016; Snell and Zemel 2020; pFed-Mul App. E) does:

    p_OVE(y = k | f) = prod_{j != k} sigmoid(f_k - f_j)  <=  softmax_k(f),

a product of ``K - 1`` binary logistic terms with label 1 and logits ``f_k - f_j``, which are
affine in ``f``. For ``K = 2`` it is the softmax exactly. :func:`one_vs_each` writes it as an
observed Bernoulli site ``"y_ove"`` of shape ``(N, K)`` whose ``j = y`` column is masked, so the
:class:`~fedppl.handlers.polya_gamma` handler, :class:`~fedppl.guides.cavi.CAVI` and
``fedppl.PVI(..., conjugate="polya-gamma")`` apply unchanged. We chose OVE over the
logistic-softmax (Galy-Fajou et al. 2020) because it needs no Poisson augmentation and its
bound is exact for two classes.

Example::

    >>> import jax, numpy as np
    >>> from functools import partial
    >>> from fedppl.guides import PVIGuide
    >>> from fedppl.guides.cavi import CAVI
    >>> rng = np.random.default_rng(0)
    >>> y = rng.integers(0, 3, 60)
    >>> X = np.eye(3)[y, :2] * 2.0 + 0.5 * rng.normal(size=(60, 2))
    >>> model = partial(one_vs_each, num_classes=3)   # the number of classes is static
    >>> guide = PVIGuide(model, family="fullrank")
    >>> result = CAVI(model, guide, num_iters=20).run(X, y)
    >>> probs = predict_proba(jax.random.key(0), guide, result.q, X[:4])
    >>> probs.shape
    (4, 3)
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array

from fedppl.families import gaussian as g

__all__ = ["one_vs_each", "ove_log_lik", "class_logits", "predict_proba", "Sampler"]


class Sampler(Protocol):
    """What :func:`predict_proba` needs of a guide (a :class:`~fedppl.guides.PVIGuide` has it):
    constrained draws from ``q``, keyed by site, ``{name: (num_samples, *shape)}``."""

    def sample(self, rng_key: Array, q: g.Gaussian, num_samples: int) -> dict[str, Array]: ...


def class_logits(X: Array, W: Array, b: Array) -> Array:
    """``(N, K)`` latent class functions ``X W + b``."""
    return X @ W + b


def one_vs_each(X: Array, y: Array | None = None, num_classes: int = 3,
                prior_scale: float = 1.0) -> None:
    """Linear multi-class model with the OVE likelihood; labels ``y`` in ``{0, ..., K - 1}``.

    Weights ``W (D, K)`` and biases ``b (K,)`` have ``N(0, prior_scale^2)`` priors. Without ``y``
    the model samples labels from the softmax of the class functions (site ``"y"``).
    """
    K = int(num_classes)
    if K < 2:
        raise ValueError(f"one_vs_each needs at least 2 classes, got {K}")
    W = numpyro.sample("W", dist.Normal(0.0, prior_scale).expand([X.shape[1], K]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale).expand([K]).to_event(1))
    F = class_logits(X, W, b)
    with numpyro.plate("data", X.shape[0]):
        if y is None:
            numpyro.sample("y", dist.Categorical(logits=F))
            return
        _check_labels(y, K)
        labels = jnp.asarray(y).astype(jnp.int32)
        own = jnp.take_along_axis(F, labels[:, None], axis=1)
        others = jnp.arange(K)[None, :] != labels[:, None]
        numpyro.sample("y_ove", dist.Bernoulli(logits=own - F).mask(others).to_event(1),
                       obs=jnp.ones(F.shape, F.dtype))


def ove_log_lik(F: Array, y: Array) -> Array:
    """``log p_OVE(y | F)`` per row: ``sum_{j != y} log sigmoid(F_y - F_j)``."""
    labels = jnp.asarray(y).astype(jnp.int32)
    own = jnp.take_along_axis(F, labels[:, None], axis=1)
    others = jnp.arange(F.shape[1])[None, :] != labels[:, None]
    return jnp.sum(jnp.where(others, jax.nn.log_sigmoid(own - F), 0.0), axis=1)


def predict_proba(rng_key: Array, guide: Sampler, q: g.Gaussian, X: Array,
                  num_samples: int = 500) -> Array:
    """Posterior predictive class probabilities ``E_q[softmax(X W + b)]`` by Monte Carlo."""
    draws = guide.sample(rng_key, q, num_samples)
    F = jnp.einsum("nd,sdk->snk", X, draws["W"]) + draws["b"][:, None, :]
    return jnp.mean(jax.nn.softmax(F, axis=-1), axis=0)


def _check_labels(y: Array, K: int) -> None:
    if isinstance(y, jax.core.Tracer):
        return
    a = np.asarray(y)
    bad = ~np.isin(a, np.arange(K))
    if bad.any():
        raise ValueError(f"one_vs_each: labels {np.unique(a[bad])[:5].tolist()} are not class "
                         f"indices in 0..{K - 1}")
