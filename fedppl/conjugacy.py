"""What every conjugacy check reads off a model: its observed sites at a point, and affinity.

A client's likelihood has a closed-form factor when each observed site's parameter (a Normal's
mean, a Bernoulli's logit) is affine in the real-valued global sites ``theta``. Two paths build on
that: :mod:`fedppl.algorithms.conjugate` (Normal observations, the exact Gaussian factor) and
:mod:`fedppl.guides.cavi` (Bernoulli observations after Polya-Gamma augmentation). Both read the
observed sites with :func:`observed_sites`, test affinity with :func:`affine_reason` and refuse
constrained global sites with :func:`constrained_reason`; a model that is not in the case raises
:class:`NotConjugate` inside them, which their ``check`` turns into the reason it returns.

Example::

    >>> import jax.numpy as jnp, numpy as np
    >>> from fedppl.models import linear_regression as model
    >>> from fedppl.sites import SiteLayout
    >>> X = np.ones((4, 2))
    >>> layout = SiteLayout.from_model(model, X, np.zeros(4))
    >>> [(s.name, type(s.fn).__name__, s.value.shape)
    ...  for s in observed_sites(model, layout, jnp.zeros(layout.dim), (X, np.zeros(4)), {})]
    [('y', 'Normal', (4,))]
    >>> print(affine_reason(lambda t: X @ t[:2] + t[2], layout.dim, layout.dtype))
    None
    >>> affine_reason(lambda t: jnp.exp(X @ t[:2]), layout.dim, layout.dtype)
    'the mean of an observed site is not affine in the global sites'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import Array
from numpyro import handlers

from fedppl.model_call import READS_VALUES
from fedppl.sites import SiteLayout, cast_floats, is_identity

__all__ = ["NotConjugate", "ObservedSite", "observed_sites", "affine_reason",
           "constrained_reason"]


class NotConjugate(Exception):
    """The model is not in the conjugate case (the message says why)."""


class ObservedSite(NamedTuple):
    """An observed site with its distribution unwrapped from masks, ``Independent`` and expansion:
    ``weight`` (shape of ``value``) folds in the masks and the site's scale."""

    name: str
    fn: dist.Distribution
    value: Array
    weight: Array


def observed_sites(model: Callable, layout: SiteLayout, theta: Array, args: tuple, kwargs: dict
                   ) -> list[ObservedSite]:
    """The observed sites of ``model`` run at the flat global vector ``theta``.

    Raises :class:`NotConjugate` if a latent site is not one of the layout's global sites.
    """
    values = layout.constrain(theta)
    tr = handlers.trace(handlers.substitute(handlers.seed(model, 0), data=values)).get_trace(
        *cast_floats(args, layout.dtype), **kwargs
    )
    out = []
    for name, site in tr.items():
        if site["type"] != "sample":
            continue
        if not site["is_observed"]:
            if name not in layout.names:
                raise NotConjugate(f"latent site '{name}' is not a global site")
            continue
        fn, value = site["fn"], site["value"]
        weight = jnp.ones(jnp.shape(value), layout.dtype)
        while True:
            if isinstance(fn, dist.MaskedDistribution):
                mask = jnp.reshape(fn._mask, jnp.shape(fn._mask) + (1,) * len(fn.event_shape))
                weight = weight * mask
                fn = fn.base_dist
            elif isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
                fn = fn.base_dist
            else:
                break
        if site["scale"] is not None:
            weight = weight * site["scale"]
        out.append(ObservedSite(name, fn, value, jnp.broadcast_to(weight, jnp.shape(value))))
    return out


def affine_reason(fn: Callable[[Array], Array], dim: int, dtype: Any, seed: int = 0,
                  what: str = "the mean of an observed site") -> str | None:
    """``None`` if ``fn(theta) = fn(0) + J theta`` at two random points, else the reason.

    The tolerance is relative to the size of the terms, ``|fn(0)| + |J| |theta|``: ``1e-5`` of
    it, or ``100 * eps`` of it where the dtype's rounding is coarser (``J @ theta`` and
    ``fn(theta)`` round differently, by up to a few ``eps`` of those terms each)."""
    theta0 = jnp.zeros(dim, dtype=dtype)
    value, jacobian = jax.jit(fn), jax.jit(jax.jacfwd(fn))  # not op by op: see model_call
    try:
        loc0, J = value(theta0), jacobian(theta0)
    except READS_VALUES:
        value, jacobian = fn, jax.jacfwd(fn)
        loc0, J = value(theta0), jacobian(theta0)
    loc0, J = np.asarray(loc0), np.asarray(J)
    rel = max(1e-5, 100 * float(np.finfo(loc0.dtype).eps))
    rng = np.random.default_rng(seed)
    for _ in range(2):
        theta = jnp.asarray(rng.normal(size=dim) * 3.0, dtype=dtype)
        loc, t = np.asarray(value(theta)), np.asarray(theta)
        size = np.abs(loc0) + np.abs(J) @ np.abs(t)
        tol = rel * (1.0 + np.maximum(np.max(np.abs(loc)), size))
        if not np.all(np.abs(loc - (loc0 + J @ t)) <= tol):
            return f"{what} is not affine in the global sites"
    return None


def constrained_reason(layout: SiteLayout) -> str | None:
    """``None`` if every global site is real-valued (an identity transform), else the reason."""
    for s in layout.sites:
        if not is_identity(s.transform):
            return f"global site '{s.name}' is constrained ({type(s.transform).__name__})"
    return None
