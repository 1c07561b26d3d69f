"""The conjugate case on a Pyro model: a Gaussian likelihood whose mean is affine in the global
sites, read by torch, solved by the core.

When every observed site is ``Normal(loc(theta), scale)`` with ``loc`` affine in ``theta``,
``scale`` free of it and every global site real-valued, a client's likelihood is exactly a
Gaussian factor in ``theta``. :func:`check` decides whether a Pyro model is in this case
(numerically, at random points); :func:`likelihood_terms` reads ``J``, the residual at zero and
the precisions from it (``torch.func.jacfwd``) as the core's
:class:`~fedppl.algorithms.conjugate.GaussianLikelihood`. :class:`ConjugateSolver` is the core's
closed-form local step (:class:`fedppl.algorithms.pvi.ConjugateSolver`) on those terms.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from fedppl.algorithms.conjugate import likelihood_factor
    >>> from fedppl.pyro.bridge import to_jax
    >>> from fedppl.pyro.guides import PVIGuide
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
    >>> X = torch.randn(20, 2)
    >>> layout = PVIGuide(model).setup(X, X.sum(1)).layout
    >>> check(model, layout, X, X.sum(1)) is None             # None when conjugate
    True
    >>> likelihood_factor(to_jax(likelihood_terms(model, layout, X, X.sum(1)))).prec.shape
    (2, 2)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax.numpy as jnp
import numpy as np
import pyro.distributions as dist
import torch
from jax import Array
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from fedppl.algorithms import conjugate as core
from fedppl.algorithms.conjugate import GaussianLikelihood
from fedppl.algorithms.natural_gradient import LocalResult
from fedppl.families import gaussian as g
from fedppl.pyro.algorithms.terms import model_terms
from fedppl.pyro.handlers.substitute import substitute
from fedppl.pyro.sites import SiteLayout, cast_floats, is_identity, nodes, quiet, using

__all__ = ["NotConjugate", "ObservedSite", "observed_sites", "check", "likelihood_terms",
           "affine_reason", "ConjugateSolver"]


class NotConjugate(Exception):
    pass


class ObservedSite(NamedTuple):
    name: str
    fn: Any
    value: Tensor
    weight: Tensor


def observed_sites(model: Callable, layout: SiteLayout, theta: Tensor, args: tuple,
                   kwargs: dict) -> list[ObservedSite]:
    """The observed sites of ``model`` at the flat global vector ``theta``, unwrapped from
    ``Independent``, expansions and masks (masks and scales folded into ``weight``)."""
    args = cast_floats(args, layout.dtype)
    with quiet(), using(layout.dtype):
        tr = poutine.trace(substitute(model, layout.constrain(theta))).get_trace(*args, **kwargs)
    out = []
    for name, site in nodes(tr).items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        if not site["is_observed"]:
            if name not in layout.names:
                raise NotConjugate(f"latent site '{name}' is not a global site")
            continue
        fn, value = site["fn"], site["value"]
        weight = torch.ones(value.shape, dtype=layout.dtype)
        while True:
            if isinstance(fn, dist.MaskedDistribution):
                m = fn._mask
                weight = weight * torch.as_tensor(m).reshape(
                    torch.as_tensor(m).shape + (1,) * len(fn.event_shape))
                fn = fn.base_dist
            elif isinstance(fn, (torch.distributions.Independent, dist.ExpandedDistribution)):
                fn = fn.base_dist
            else:
                break
        if site["mask"] is not None:
            weight = weight * torch.as_tensor(site["mask"])
        weight = weight * site["scale"]
        out.append(ObservedSite(name, fn, value, weight.expand(value.shape)))
    return out


def affine_reason(fn: Callable[[Tensor], Tensor], dim: int, dtype: torch.dtype, seed: int = 0,
                  what: str = "the mean of an observed site") -> str | None:
    """``None`` if ``fn(theta) = fn(0) + J theta`` at two random points, else the reason (the
    tolerance relative to the terms' size, as in the NumPyro core)."""
    theta0 = torch.zeros(dim, dtype=dtype)
    loc0 = fn(theta0)
    J = torch.func.jacfwd(fn)(theta0)
    rel = max(1e-5, 100 * float(torch.finfo(loc0.dtype).eps))
    rng = np.random.default_rng(seed)
    for _ in range(2):
        theta = torch.as_tensor(rng.normal(size=dim) * 3.0, dtype=dtype)
        loc = fn(theta)
        size = loc0.abs() + J.abs() @ theta.abs()
        tol = rel * (1.0 + torch.maximum(loc.abs().max(), size))
        if not bool(((loc - (loc0 + J @ theta)).abs() <= tol).all()):
            return f"{what} is not affine in the global sites"
    return None


def _normal_observations(model: Callable, layout: SiteLayout, theta: Tensor, args: tuple,
                         kwargs: dict) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flat ``loc``, ``scale``, ``y`` and weight of all observed sites at ``theta``."""
    locs, scales, ys, weights = [], [], [], []
    for name, fn, value, weight in observed_sites(model, layout, theta, args, kwargs):
        if not isinstance(fn, torch.distributions.Normal):
            raise NotConjugate(f"observed site '{name}' is {type(fn).__name__}, not Normal")
        locs.append(fn.loc.expand(value.shape).reshape(-1))
        scales.append(fn.scale.expand(value.shape).reshape(-1))
        ys.append(value.reshape(-1))
        weights.append(weight.reshape(-1))
    if not locs:
        raise NotConjugate("the model has no observed sites")
    return tuple(torch.cat(p).to(layout.dtype)  # type: ignore[return-value]
                 for p in (locs, scales, ys, weights))


def likelihood_terms(model: Callable, layout: SiteLayout, *args: Any, **kwargs: Any
                     ) -> GaussianLikelihood:
    """``J``, residual at zero and precisions of a conjugate model."""
    theta0 = torch.zeros(layout.dim, dtype=layout.dtype)
    loc0, scale, y, weight = _normal_observations(model, layout, theta0, args, kwargs)
    J = torch.func.jacfwd(lambda t: _normal_observations(model, layout, t, args, kwargs)[0])(
        theta0)
    prec = weight / scale**2
    safe = torch.where(weight > 0, scale, 1.0)
    log_norm = -0.5 * torch.sum(weight * torch.log(2 * math.pi * safe**2))
    terms: Any = (J, y - loc0, prec, log_norm)  # the core's terms, in torch
    return GaussianLikelihood(*terms)


def check(model: Callable, layout: SiteLayout, *args: Any, seed: int = 0, **kwargs: Any
          ) -> str | None:
    """``None`` if the model is conjugate in its global sites, else the reason it is not."""
    for s in layout.sites:
        if not is_identity(s.transform):
            return f"global site '{s.name}' is constrained ({type(s.transform).__name__})"
    try:
        theta0 = torch.zeros(layout.dim, dtype=layout.dtype)
        _, scale0, _, _ = _normal_observations(model, layout, theta0, args, kwargs)
        reason = affine_reason(
            lambda t: _normal_observations(model, layout, t, args, kwargs)[0], layout.dim,
            layout.dtype, seed)
        if reason is not None:
            return reason
        rng = np.random.default_rng(seed + 1)
        theta = torch.as_tensor(rng.normal(size=layout.dim) * 3.0, dtype=layout.dtype)
        _, scale, _, _ = _normal_observations(model, layout, theta, args, kwargs)
        if not torch.allclose(scale, scale0):
            return "the scale of an observed site depends on the global sites"
    except NotConjugate as e:
        return str(e)
    return None


class ConjugateSolver(NamedTuple):
    """The core's closed-form local step (:class:`fedppl.algorithms.pvi.ConjugateSolver`) with the
    client's likelihood terms read from the Pyro model by torch."""

    model: Callable
    guide: Any

    def terms(self, data: tuple, mask: Array) -> GaussianLikelihood:
        return GaussianLikelihood(*model_terms(likelihood_terms, self.model, self.guide, data,
                                               mask))

    def __call__(self, q_cavity, q, data, mask, rng_key):
        lik = self.terms(data, mask)
        target = cast(g.FullGaussian, g.product(g.to_full(q_cavity), core.likelihood_factor(lik)))
        q_new = g.project_diag(target) if self.guide.diag else target
        mean, cov = g.to_moments(g.to_full(q_new))
        free_energy = core.expected_log_lik(lik, mean, cov) - g.kl(q_new, q_cavity)
        return LocalResult(q_new, free_energy, jnp.asarray(True), jnp.asarray(1))

    def expected_log_lik(self, q: g.Gaussian, data: tuple, mask: Array) -> Array:
        """The client's ``E_q[log p(y_k | theta)]`` in closed form."""
        mean, cov = g.to_moments(g.to_full(q))
        return core.expected_log_lik(self.terms(data, mask), mean, cov)
