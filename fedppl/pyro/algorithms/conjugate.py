"""The conjugate case in torch: a Gaussian likelihood whose mean is affine in the global sites.

The twin of :mod:`fedppl.algorithms.conjugate`: when every observed site is ``Normal(loc(theta),
scale)`` with ``loc`` affine in ``theta``, ``scale`` free of it and every global site real-valued,
a client's likelihood is exactly a Gaussian factor in ``theta`` and the local free energy has a
closed-form maximiser. :func:`check` decides whether a model is in this case (numerically, at
random points); :func:`likelihood_terms` reads ``J``, the residual at zero and the precisions from
the model (``torch.func.jacfwd``). The terms do not depend on ``q``, so a run reads them once.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from fedppl.pyro.guides import PVIGuide
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
    >>> X = torch.randn(20, 2)
    >>> layout = PVIGuide(model).setup(X, X.sum(1)).layout
    >>> check(model, layout, X, X.sum(1)) is None             # None when conjugate
    True
    >>> likelihood_factor(likelihood_terms(model, layout, X, X.sum(1))).prec.shape
    torch.Size([2, 2])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from fedppl.pyro.families.gaussian import FullGaussian
from fedppl.pyro.handlers.substitute import substitute
from fedppl.pyro.sites import SiteLayout, cast_floats, is_identity, nodes, quiet, using

__all__ = ["NotConjugate", "GaussianLikelihood", "ObservedSite", "observed_sites", "check",
           "likelihood_terms", "likelihood_factor", "expected_log_lik", "affine_reason"]


class NotConjugate(Exception):
    pass


class GaussianLikelihood(NamedTuple):
    """All observations flattened: ``y_n ~ N(loc0_n + J_n theta, 1 / prec_n)``, weights folded
    into ``prec`` (zero for masked rows)."""

    J: Tensor
    resid: Tensor
    prec: Tensor
    log_norm: Tensor


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
    return GaussianLikelihood(J, y - loc0, prec, log_norm)


def likelihood_factor(lik: GaussianLikelihood) -> FullGaussian:
    """The likelihood as a Gaussian factor in ``theta`` (batched over leading axes)."""
    Jw = lik.J * lik.prec.unsqueeze(-1)
    Jt = Jw.transpose(-1, -2)
    return FullGaussian(torch.einsum("...dn,...n->...d", Jt, lik.resid),
                        lik.J.transpose(-1, -2) @ Jw)


def expected_log_lik(lik: GaussianLikelihood, mean: Tensor, cov: Tensor) -> Tensor:
    """``E_q[log p(y | theta)]`` for ``q = N(mean, cov)``; ``mean``/``cov`` may carry a leading
    candidate axis in front of ``lik``'s."""
    err = lik.resid - torch.einsum("...nd,...d->...n", lik.J, mean)
    spread = ((lik.J @ cov) * lik.J).sum(-1)
    return lik.log_norm - 0.5 * torch.sum(lik.prec * (err**2 + spread), dim=-1)


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
