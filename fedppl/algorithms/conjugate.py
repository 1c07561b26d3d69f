"""The conjugate case: a Gaussian likelihood whose mean is affine in the global sites.

When every observed site is ``Normal(loc(theta), scale)`` with ``loc`` affine in ``theta``,
``scale`` free of ``theta``, and every global site real-valued, client k's likelihood is exactly
a Gaussian factor in ``theta``:

    log p(y_k | theta) = -1/2 sum_n w_n / s_n^2 (r_n - J_n theta)^2 + const,   r = y - loc(0),

so the local free energy has a closed-form maximiser (``q = cavity * likelihood`` for a full-rank
family, its mean-field projection otherwise). :func:`check` decides whether a model is in this case
(numerically, on random points); :func:`likelihood_terms` extracts ``J``, ``r`` and the weights.
The observed sites and the affinity test come from :mod:`fedppl.conjugacy`, which the
Polya-Gamma path (:mod:`fedppl.guides.cavi`) shares; they stay importable from here.

Example::

    >>> import numpy as np, fedppl
    >>> from fedppl.models import linear_regression as model
    >>> X = np.random.default_rng(0).normal(size=(20, 2))
    >>> layout = fedppl.PVIGuide(model).setup(X, X @ np.ones(2)).layout
    >>> check(model, layout, X, X @ np.ones(2)) is None      # None when conjugate
    True
    >>> lik = likelihood_terms(model, layout, X, X @ np.ones(2))
    >>> likelihood_factor(lik).prec.shape                   # FullGaussian in natural parameters
    (3, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import Array

from fedppl.conjugacy import (
    NotConjugate,
    ObservedSite,
    affine_reason,
    constrained_reason,
    observed_sites,
)
from fedppl.families.gaussian import FullGaussian
from fedppl.sites import SiteLayout

__all__ = ["GaussianLikelihood", "ObservedSite", "check", "likelihood_terms",
           "likelihood_factor", "expected_log_lik", "observed_sites", "affine_reason"]


class GaussianLikelihood(NamedTuple):
    """All observations flattened: ``y_n ~ N(loc0_n + J_n theta, 1 / prec_n)`` with weight folded
    into ``prec`` (zero for masked rows)."""

    J: Array  # (n_obs, D)
    resid: Array  # (n_obs,) y - loc(0)
    prec: Array  # (n_obs,) weight / scale^2
    log_norm: Array  # () sum_n weight_n * (-1/2 log(2 pi scale_n^2))


def _normal_observations(model: Callable, layout: SiteLayout, theta: Array, args: tuple,
                         kwargs: dict) -> tuple[Array, Array, Array, Array]:
    """Flat ``loc``, ``scale``, ``y`` and weight of all observed sites at ``theta``."""
    locs, scales, ys, weights = [], [], [], []
    for name, fn, value, weight in observed_sites(model, layout, theta, args, kwargs):
        if not isinstance(fn, dist.Normal):
            raise NotConjugate(f"observed site '{name}' is {type(fn).__name__}, not Normal")
        shape = jnp.shape(value)
        locs.append(jnp.broadcast_to(fn.loc, shape).reshape(-1))
        scales.append(jnp.broadcast_to(fn.scale, shape).reshape(-1))
        ys.append(jnp.reshape(value, (-1,)))
        weights.append(jnp.reshape(weight, (-1,)))
    if not locs:
        raise NotConjugate("the model has no observed sites")
    # in the layout's dtype: a scale of Python floats is float64 under x64 once concatenated
    loc, scale, y, weight = (jnp.concatenate(p).astype(layout.dtype)
                             for p in (locs, scales, ys, weights))
    return loc, scale, y, weight


def likelihood_terms(model: Callable, layout: SiteLayout, *args: Any, **kwargs: Any
                     ) -> GaussianLikelihood:
    """``J``, residual at zero and precisions of a conjugate model (see module doc)."""
    theta0 = jnp.zeros(layout.dim, layout.dtype)
    loc0, scale, y, weight = _normal_observations(model, layout, theta0, args, kwargs)
    J = jax.jacfwd(lambda t: _normal_observations(model, layout, t, args, kwargs)[0])(theta0)
    prec = weight / scale**2
    safe = jnp.where(weight > 0, scale, 1.0)
    log_norm = -0.5 * jnp.sum(weight * jnp.log(2 * jnp.pi * safe**2))
    return GaussianLikelihood(J, y - loc0, prec, log_norm)


def likelihood_factor(lik: GaussianLikelihood) -> FullGaussian:
    """The likelihood as a Gaussian factor in ``theta`` (natural parameters)."""
    Jw = lik.J * lik.prec[:, None]
    return FullGaussian(Jw.T @ lik.resid, lik.J.T @ Jw)


def expected_log_lik(lik: GaussianLikelihood, mean: Array, cov: Array) -> Array:
    """``E_q[log p(y | theta)]`` for ``q = N(mean, cov)`` (``cov`` a matrix)."""
    err = lik.resid - lik.J @ mean
    spread = jnp.einsum("nd,de,ne->n", lik.J, cov, lik.J)
    return lik.log_norm - 0.5 * jnp.sum(lik.prec * (err**2 + spread))


def check(model: Callable, layout: SiteLayout, *args: Any, seed: int = 0, **kwargs: Any
          ) -> str | None:
    """``None`` if the model is conjugate in its global sites, else the reason it is not.

    Affinity of the mean and constancy of the scale are checked at random points, so a model that
    is affine only near zero would pass; such models are rare and the check is documented.
    """
    reason = constrained_reason(layout)
    if reason is not None:
        return reason
    try:
        theta0 = jnp.zeros(layout.dim, layout.dtype)
        _, scale0, _, _ = _normal_observations(model, layout, theta0, args, kwargs)
        reason = affine_reason(
            lambda t: _normal_observations(model, layout, t, args, kwargs)[0], layout.dim,
            layout.dtype, seed)
        if reason is not None:
            return reason
        rng = np.random.default_rng(seed + 1)
        theta = jnp.asarray(rng.normal(size=layout.dim) * 3.0, dtype=layout.dtype)
        _, scale, _, _ = _normal_observations(model, layout, theta, args, kwargs)
        if not bool(jnp.allclose(scale, scale0)):
            return "the scale of an observed site depends on the global sites"
    except NotConjugate as e:
        return str(e)
    return None
