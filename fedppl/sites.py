"""The global latent sites of a NumPyro model, flattened into one unconstrained vector.

:class:`SiteLayout` is what the cavity handler and the PVI guide agree on: for each global site
its name, constrained shape, the bijection from the unconstrained space (``biject_to(support)``,
as AutoNormal uses) and its slice of the flat vector ``theta``. :func:`prior_factor` reads the
model's prior at those sites as one Gaussian over ``theta``.

Example::

    >>> layout = SiteLayout.from_model(model, X, y)            # trace the model once
    >>> theta = jnp.zeros(layout.dim)
    >>> layout.constrain(theta)                                 # {"w": ..., "sigma": ...}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import Array
from numpyro import handlers
from numpyro.distributions.transforms import IdentityTransform, Transform, biject_to

from fedppl.families.gaussian import DiagGaussian, FullGaussian, Gaussian

__all__ = ["Site", "SiteLayout", "prior_factor", "NonGaussianPriorError"]


class NonGaussianPriorError(NotImplementedError):
    """A global site's prior is not Gaussian in the unconstrained space."""


@dataclass(frozen=True)
class Site:
    name: str
    shape: tuple[int, ...]  # constrained shape of one draw
    unconstrained_shape: tuple[int, ...]
    transform: Transform
    start: int
    size: int  # number of unconstrained coordinates
    prior: dist.Distribution  # the model's prior at this site (as traced)

    @property
    def slice(self) -> slice:
        return slice(self.start, self.start + self.size)


@dataclass(frozen=True)
class SiteLayout:
    """Ordered global latent sites and their place in the flat unconstrained vector."""

    sites: tuple[Site, ...]

    @property
    def dim(self) -> int:
        return sum(s.size for s in self.sites)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sites)

    def __getitem__(self, name: str) -> Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)

    @classmethod
    def from_model(
        cls,
        model: Callable,
        *args: Any,
        global_sites: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> SiteLayout:
        """Trace ``model(*args, **kwargs)`` once and lay out its global latent sites.

        ``global_sites=None`` takes every latent sample site. Named sites that the model does
        not have, or latent sites left out of ``global_sites``, raise a ``ValueError``.
        """
        tr = handlers.trace(handlers.seed(model, 0)).get_trace(*args, **kwargs)
        latent = {
            name: site
            for name, site in tr.items()
            if site["type"] == "sample"
            and not site["is_observed"]
            and not site["infer"].get("is_auxiliary", False)
        }
        if global_sites is None:
            names = list(latent)
        else:
            names = list(global_sites)
            missing = [n for n in names if n not in latent]
            if missing:
                raise ValueError(
                    f"global_sites names {missing}, which the model does not have as latent "
                    f"sample sites; its latent sites are {sorted(latent)}"
                )
            local = [n for n in latent if n not in names]
            if local:
                raise ValueError(
                    f"latent sites {local} are not in global_sites; PVIGuide infers global "
                    "latent variables only: add them to global_sites or make them observed"
                )
        if not names:
            raise ValueError("the model has no latent sample sites to infer")
        _refuse_dependent_priors(model, args, kwargs, {n: latent[n] for n in names})
        sites, start = [], 0
        for name in names:
            site = latent[name]
            fn = site["fn"]
            shape = tuple(jnp.shape(site["value"]))
            transform = biject_to(fn.support)
            ushape = tuple(transform.inverse_shape(shape))
            size = int(math.prod(ushape))
            sites.append(Site(name, shape, ushape, transform, start, size, fn))
            start += size
        return cls(tuple(sites))

    # -- moving between the flat vector and per-site values ------------------------------------

    def unpack(self, theta: Array) -> dict[str, Array]:
        """Unconstrained per-site values from ``theta`` of shape ``(..., dim)``."""
        lead = theta.shape[:-1]
        return {s.name: theta[..., s.slice].reshape(lead + s.unconstrained_shape) for s in self.sites}

    def constrain(self, theta: Array) -> dict[str, Array]:
        """Constrained per-site values (in the model's support) from ``theta``."""
        return {s.name: s.transform(u) for s, u in zip(self.sites, self.unpack(theta).values())}

    def unconstrain(self, values: dict[str, Array]) -> Array:
        """The flat unconstrained vector from constrained per-site values (no leading axes)."""
        parts = [jnp.reshape(s.transform.inv(values[s.name]), (-1,)) for s in self.sites]
        return jnp.concatenate(parts)

    def log_abs_det_jacobian(self, theta: Array) -> Array:
        """Sum over sites of ``log |d constrain / d theta|`` (no leading axes)."""
        total = 0.0
        for s, u in zip(self.sites, self.unpack(theta).values()):
            ladj = s.transform.log_abs_det_jacobian(u, s.transform(u))
            total = total + jnp.sum(ladj)
        return total

    def site_distribution(self, name: str, mean: Array, cov: Array, diag: bool) -> dist.Distribution:
        """The constrained-space distribution of one site when ``theta`` is Gaussian.

        ``mean``/``cov`` are the site's block of the flat mean and covariance (``cov`` a
        variance vector when ``diag``).
        """
        s = self[name]
        base = (
            dist.Normal(mean, jnp.sqrt(cov)).to_event(1)
            if diag
            else dist.MultivariateNormal(mean, covariance_matrix=cov)
        )
        return transformed(base, s)


def _refuse_dependent_priors(model: Callable, args: tuple, kwargs: dict, latent: dict) -> None:
    """Raise if a global site's prior changes with the values of other latent sites.

    The prior is read once, from one trace; a prior such as ``Normal(mu, tau)`` with ``mu`` and
    ``tau`` latent would be read as a Gaussian with one random draw of them. A second trace with
    other values shows the dependence.
    """
    other = handlers.trace(handlers.seed(model, 1)).get_trace(*args, **kwargs)
    for name, site in latent.items():
        try:
            a = jax.tree_util.tree_leaves(site["fn"])
            b = jax.tree_util.tree_leaves(other[name]["fn"])
        except (KeyError, TypeError, NotImplementedError):  # not a pytree: nothing to compare
            continue
        same = len(a) == len(b) and all(
            np.shape(x) == np.shape(y) and np.allclose(np.asarray(x), np.asarray(y))
            for x, y in zip(a, b)
        )
        if not same:
            raise NonGaussianPriorError(
                f"the prior of global site '{name}' depends on other latent sites (its "
                "parameters changed with their values between two traces of the model), so it "
                "is not one Gaussian over the unconstrained sites. PVIGuide does not support such "
                "hierarchical priors yet: make its parameters fixed (or observed), or make the "
                "site a deterministic function of fixed-prior sites (non-centred form, e.g. "
                "alpha = mu + tau * z with z ~ Normal(0, 1))"
            )


def transformed(base: dist.Distribution, site: Site) -> dist.Distribution:
    """Push a distribution over the site's flat unconstrained block into its constrained space."""
    transforms: list[Transform] = []
    if site.unconstrained_shape != (site.size,):
        transforms.append(dist.transforms.ReshapeTransform(site.unconstrained_shape, (site.size,)))
    if not is_identity(site.transform):
        transforms.append(site.transform)
    return dist.TransformedDistribution(base, transforms) if transforms else base


# -- priors as Gaussian factors in the unconstrained space ---------------------------------------


def prior_factor(layout: SiteLayout, family: str) -> Gaussian:
    """The model's prior over ``theta`` as a Gaussian of the requested family.

    Supported priors: Normal, MultivariateNormal and LogNormal (and their ``expand``/``to_event``
    forms); anything else raises :class:`NonGaussianPriorError` saying how to reparametrise.
    """
    means, covs = [], []
    for s in layout.sites:
        mean, cov = _unconstrained_gaussian(s)
        means.append(mean)
        covs.append(cov)
    mean = jnp.concatenate(means)
    if family == "meanfield":
        offdiag = [c for c in covs if c.ndim == 2 and not np.allclose(c, jnp.diag(jnp.diag(c)))]
        if offdiag:
            raise ValueError(
                "the prior correlates coordinates of a site, which a mean-field q cannot "
                "represent; use family='fullrank'"
            )
        var = jnp.concatenate([jnp.diag(c) if c.ndim == 2 else c for c in covs])
        return DiagGaussian.from_moments(mean, var)
    cov = jax.scipy.linalg.block_diag(*[c if c.ndim == 2 else jnp.diag(c) for c in covs])
    return FullGaussian.from_moments(mean, cov)


def base_transform(t: Transform) -> Transform:
    """The elementwise transform inside any ``IndependentTransform`` wrappers."""
    while isinstance(t, dist.transforms.IndependentTransform):
        t = t.base_transform
    return t


def is_identity(t: Transform) -> bool:
    return isinstance(base_transform(t), IdentityTransform)


def _unconstrained_gaussian(site: Site) -> tuple[Array, Array]:
    """Flat mean and covariance (or variance vector) of one site's prior in unconstrained space."""
    fn = site.prior
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
        fn = fn.base_dist
    shape = site.shape
    if isinstance(fn, dist.Normal) and is_identity(site.transform):
        loc = jnp.broadcast_to(fn.loc, shape).reshape(-1)
        var = jnp.broadcast_to(fn.scale**2, shape).reshape(-1)
        return loc, var
    if isinstance(fn, dist.LogNormal) or (
        isinstance(fn, dist.TransformedDistribution)
        and isinstance(fn.base_dist, dist.Normal)
        and len(fn.transforms) == 1
        and isinstance(fn.transforms[0], dist.transforms.ExpTransform)
    ):
        base = fn.base_dist
        while isinstance(base, (dist.Independent, dist.ExpandedDistribution)):
            base = base.base_dist
        if isinstance(base_transform(site.transform), dist.transforms.ExpTransform):
            loc = jnp.broadcast_to(base.loc, shape).reshape(-1)
            var = jnp.broadcast_to(base.scale**2, shape).reshape(-1)
            return loc, var
    if isinstance(fn, dist.MultivariateNormal) and fn.batch_shape == () and len(shape) == 1:
        return fn.loc, fn.covariance_matrix
    raise NonGaussianPriorError(
        f"the prior of global site '{site.name}' is {type(site.prior).__name__}, which is not "
        "Gaussian in the unconstrained space where PVIGuide's factors live. Reparametrise it: "
        "dist.Normal or dist.MultivariateNormal for real parameters, dist.LogNormal for "
        "positive ones (e.g. a LogNormal(0, 1) noise scale instead of a HalfCauchy)."
    )
