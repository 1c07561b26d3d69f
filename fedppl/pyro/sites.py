"""The global latent sites of a Pyro model, flattened into one unconstrained vector.

The torch twin of :mod:`fedppl.sites`: :class:`SiteLayout` is what the ``cavity`` messenger and
the Pyro :class:`~fedppl.pyro.guides.PVIGuide` agree on (each global site's name, constrained
shape, bijection ``biject_to(support)`` from the unconstrained space and slice of ``theta``);
:func:`classify` splits a model's latent sites into global and local ones; :func:`prior_factor`
and :func:`prior_correction` let a prior that is not one Gaussian in the unconstrained space
(HalfCauchy, Gamma, Laplace, a prior whose parameters are other latent sites) enter exactly, as
the Gaussian base ``p~`` times the correction ``log p(theta) + log|J| - log p~(theta)``.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     s = pyro.sample("s", dist.LogNormal(0.0, 1.0))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, s), obs=y)
    >>> layout = SiteLayout.from_model(model, torch.zeros(5, 2), torch.zeros(5))
    >>> layout.dim, layout.names, layout.corrected          # LogNormal: Gaussian in log s
    (3, ('w', 's'), ())
    >>> {k: tuple(v.shape) for k, v in layout.constrain(torch.zeros(3)).items()}
    {'w': (2,), 's': ()}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import Tensor
from torch.distributions import biject_to
from torch.distributions import transforms as T

from fedppl.pyro.bridge import quiet, using
from fedppl.pyro.families.gaussian import DiagGaussian, FullGaussian, Gaussian

__all__ = ["Site", "SiteLayout", "classify", "prior_factor", "prior_correction", "curvature",
           "float_dtype", "cast_floats", "trace", "nodes", "original", "quiet", "using",
           "transformed", "is_prior_factor"]

BASE_DRAWS = 512  # prior draws that place the Gaussian base of a corrected site


def float_dtype(dtype: Any = None) -> torch.dtype:
    """``dtype``, or torch's default floating dtype."""
    return torch.get_default_dtype() if dtype is None else dtype


def cast_floats(arrays: Sequence[Any], dtype: torch.dtype) -> tuple:
    """``arrays`` as tensors, the floating ones in ``dtype`` (integer and boolean as they are)."""
    out = []
    for a in arrays:
        t = a if isinstance(a, Tensor) else torch.as_tensor(np.asarray(a))
        out.append(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)
    return tuple(out)


def nodes(tr: poutine.Trace) -> dict[str, Any]:
    """A trace's sites, as plain dicts (Pyro types their distribution as a bare callable)."""
    return cast(dict[str, Any], tr.nodes)


def original(err: BaseException) -> BaseException:
    """The exception a model raised, without the table of site shapes ``poutine.trace`` appends
    when it re-raises it."""
    while err.__cause__ is not None and "Trace Shapes:" in str(err):
        err = err.__cause__
    return err


def trace(model: Callable, args: tuple, kwargs: dict, seed: int = 0,
          dtype: torch.dtype | None = None) -> poutine.Trace:
    """The trace of ``model(*args, **kwargs)`` with torch's random state seeded (and restored),
    in ``dtype`` (default: that of the first floating argument)."""
    floats = [a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point()]
    dtype = dtype or (floats[0] if floats else torch.get_default_dtype())
    with torch.random.fork_rng(devices=[]), using(dtype):
        torch.manual_seed(seed)
        return poutine.trace(model).get_trace(*args, **kwargs)


@dataclass(frozen=True)
class Site:
    name: str
    shape: tuple[int, ...]  # constrained shape of one draw
    unconstrained_shape: tuple[int, ...]
    transform: T.Transform
    start: int
    size: int
    prior: dist.Distribution
    gaussian: tuple[Tensor, Tensor] | None = None  # (mean, cov or var) of a Gaussian prior
    base: tuple[Tensor, Tensor] | None = None  # a corrected site's base (mean, variance)

    @property
    def slice(self) -> slice:
        return slice(self.start, self.start + self.size)


@dataclass(frozen=True)
class SiteLayout:
    """Ordered global latent sites and their place in the flat unconstrained vector; ``dtype`` is
    the floating dtype ``theta`` computes in (default: torch's default dtype)."""

    sites: tuple[Site, ...]
    dtype: Any = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", float_dtype(self.dtype))

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
    def from_model(cls, model: Callable, *args: Any, global_sites: Sequence[str] | None = None,
                   **kwargs: Any) -> SiteLayout:
        """Trace ``model(*args, **kwargs)`` once and lay out its global latent sites (every
        latent site unless ``global_sites`` names them; others raise a ``ValueError``)."""
        tr, names, local = classify(model, args, kwargs, global_sites, None)
        if local:
            raise ValueError(
                f"latent sites {local} are not in global_sites; a SiteLayout holds global sites "
                "only (PVIGuide treats the others as local sites of each client)")
        return cls.from_trace(model, args, kwargs, tr, names)

    @classmethod
    def from_trace(cls, model: Callable, args: tuple, kwargs: dict, tr: poutine.Trace,
                   names: Sequence[str], priors: bool = True, dtype: Any = None) -> SiteLayout:
        """Lay out the sites ``names`` of the trace ``tr``; with ``priors``, sites whose prior is
        not one fixed Gaussian in the unconstrained space get a Gaussian base from prior draws."""
        dtype = float_dtype(dtype)
        dependent = (_dependent_sites(model, args, kwargs, tr, names) if priors else set(names))
        sites, start = [], 0
        for name in names:
            node = nodes(tr)[name]
            fn = node["fn"]
            shape = tuple(node["value"].shape)
            try:
                transform = simplify(biject_to(fn.support))
            except NotImplementedError as e:
                raise ValueError(
                    f"latent site '{name}' has support {fn.support}, which torch cannot map to "
                    "an unconstrained space (no biject_to); give it a prior with a supported "
                    "support or make it observed") from e
            ushape = tuple(transform.inverse_shape(torch.Size(shape)))
            size = int(math.prod(ushape))
            gaussian = None if name in dependent else _fixed_gaussian(fn, transform, shape)
            if gaussian is not None:
                gaussian = (gaussian[0].to(dtype), gaussian[1].to(dtype))
            sites.append(Site(name, shape, ushape, transform, start, size, fn, gaussian))
            start += size
        layout = cls(tuple(sites), dtype)
        if priors and layout.corrected:
            layout = layout._with_bases(model, args, kwargs)
        return layout

    @property
    def corrected(self) -> tuple[str, ...]:
        """Sites whose prior is not one fixed Gaussian over their unconstrained coordinates."""
        return tuple(s.name for s in self.sites if s.gaussian is None)

    def _with_bases(self, model: Callable, args: tuple, kwargs: dict) -> SiteLayout:
        """Each corrected site's diagonal Gaussian base: median and interquartile range of the
        unconstrained coordinates of prior draws (robust to heavy tails)."""
        names = self.corrected

        def draw(_):
            tr = poutine.trace(model).get_trace(*args, **kwargs)
            return {n: self[n].transform.inv(nodes(tr)[n]["value"]).reshape(-1) for n in names}

        with torch.random.fork_rng(devices=[]), using(self.dtype):
            torch.manual_seed(0)
            try:  # one vectorised pass; a model that cannot be vmapped is drawn one by one
                with quiet():
                    draws = torch.func.vmap(draw, randomness="different")(torch.arange(BASE_DRAWS))
            except Exception:
                parts = [draw(i) for i in range(BASE_DRAWS)]
                draws = {n: torch.stack([p[n] for p in parts]) for n in names}
        sites = []
        for s in self.sites:
            if s.gaussian is None:
                u = draws[s.name].detach().double().numpy()
                u = np.where(np.isfinite(u), u, np.nan)
                loc = np.nan_to_num(np.nanmedian(u, axis=0))
                q25, q75 = np.nanpercentile(u, [25, 75], axis=0)
                sd = np.clip(np.nan_to_num((q75 - q25) / 1.349, nan=1.0), 1e-3, 1e3)
                s = Site(s.name, s.shape, s.unconstrained_shape, s.transform, s.start, s.size,
                         s.prior, None, (torch.as_tensor(loc, dtype=self.dtype),
                                         torch.as_tensor(sd**2, dtype=self.dtype)))
            sites.append(s)
        return SiteLayout(tuple(sites), self.dtype)

    # -- between the flat vector and per-site values -------------------------------------------

    def unpack(self, theta: Tensor) -> dict[str, Tensor]:
        """Unconstrained per-site values from ``theta`` of shape ``(..., dim)``."""
        lead = theta.shape[:-1]
        return {s.name: theta[..., s.slice].reshape(lead + s.unconstrained_shape)
                for s in self.sites}

    def constrain(self, theta: Any) -> dict[str, Tensor]:
        """Constrained per-site values (in the model's support) from ``theta`` (a tensor, or a
        JAX or NumPy array: the core's results' draws)."""
        if not isinstance(theta, Tensor):
            theta = torch.as_tensor(np.array(theta))
        values = self.unpack(theta).values()
        return {s.name: s.transform(u) for s, u in zip(self.sites, values, strict=True)}

    def unconstrain(self, values: dict[str, Tensor]) -> Tensor:
        """The flat unconstrained vector from constrained per-site values (no leading axes)."""
        return torch.cat([s.transform.inv(torch.as_tensor(values[s.name])).reshape(-1)
                          for s in self.sites])

    def site_distribution(self, name: str, mean: Tensor, cov: Tensor, diag: bool
                          ) -> dist.Distribution:
        """The constrained-space distribution of one site when ``theta`` is Gaussian."""
        base = (dist.Normal(mean, cov.sqrt()).to_event(1) if diag
                else dist.MultivariateNormal(mean, covariance_matrix=cov))
        return transformed(base, self[name])


def classify(model: Callable, args: tuple, kwargs: dict,
             global_sites: Sequence[str] | None, local_sites: Sequence[str] | None
             ) -> tuple[poutine.Trace, list[str], list[str]]:
    """Trace the model and split its latent sites into global and local ones (as the NumPyro
    core's :func:`fedppl.sites.classify`, with the same errors)."""
    tr = trace(model, args, kwargs)
    latent = [name for name, site in nodes(tr).items()
              if site["type"] == "sample" and not site["is_observed"]
              and not site_is_subsample(site) and not site["infer"].get("is_auxiliary", False)]
    for name in latent:
        if getattr(nodes(tr)[name]["fn"].support, "is_discrete", False):
            raise ValueError(
                f"latent site '{name}' is discrete ({type(nodes(tr)[name]['fn']).__name__}); "
                "fedppl's guides are Gaussian over continuous sites. Marginalise it out (sum it "
                "out in the likelihood, e.g. with dist.MixtureSameFamily, or with Pyro's "
                "enumeration), or make it observed")
    for which, given in (("global_sites", global_sites), ("local_sites", local_sites)):
        if given is not None:
            missing = [n for n in given if n not in latent]
            if missing:
                raise ValueError(
                    f"{which} names {missing}, which the model does not have as latent sample "
                    f"sites; its latent sites are {latent}")
    if global_sites is not None and local_sites is not None:
        both = set(global_sites) & set(local_sites)
        left = [n for n in latent if n not in global_sites and n not in local_sites]
        if both or left:
            raise ValueError(
                f"global_sites and local_sites must split the latent sites {latent}: "
                f"{sorted(both)} are in both, {left} in neither")
    if global_sites is not None:
        names = [n for n in latent if n in set(global_sites)]
    elif local_sites is not None:
        names = [n for n in latent if n not in set(local_sites)]
    else:
        names = list(latent)
    local = [n for n in latent if n not in names]
    if not latent:
        raise ValueError("the model has no latent sample sites to infer")
    sizes = {np.shape(a)[0] for a in args if np.ndim(a) > 0}
    for name in local:
        plates = [f for f in nodes(tr)[name]["cond_indep_stack"] if f.size in sizes]
        if plates:
            raise ValueError(
                f"local site '{name}' sits in the plate '{plates[0].name}' over the data points "
                "(one latent value per data point); fedppl's local sites are per-client or "
                "per-group quantities: put it in a plate over groups, or marginalise it out")
    return tr, names, local


def _tensors(fn: Any) -> list[Tensor]:
    """Every tensor a distribution holds (its parameters, those of its base distributions)."""
    out: list[Tensor] = []
    for value in vars(fn).values():
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, torch.distributions.Distribution):
            out += _tensors(value)
    return out


def _dependent_sites(model: Callable, args: tuple, kwargs: dict, tr: poutine.Trace,
                     names: Sequence[str]) -> set[str]:
    """The sites among ``names`` whose prior changes with the values of other latent sites (seen
    as other parameters in a second trace with other draws)."""
    other = trace(model, args, kwargs, seed=1)
    out = set()
    for name in names:
        a, b = _tensors(nodes(tr)[name]["fn"]), _tensors(nodes(other)[name]["fn"])
        same = len(a) == len(b) and all(
            x.shape == y.shape and torch.allclose(x.detach(), y.detach())
            for x, y in zip(a, b, strict=True))
        if not same:
            out.add(name)
    return out


def transformed(base: dist.Distribution, site: Site) -> dist.Distribution:
    """Push a distribution over the site's flat unconstrained block into its constrained space."""
    parts: list[T.Transform] = []
    if site.unconstrained_shape != (site.size,):
        parts.append(T.ReshapeTransform(torch.Size((site.size,)),
                                        torch.Size(site.unconstrained_shape)))
    if not is_identity(site.transform):
        parts.append(site.transform)
    return dist.TransformedDistribution(base, parts) if parts else base


# -- priors as Gaussian factors in the unconstrained space ---------------------------------------


def prior_factor(layout: SiteLayout, family: str) -> Gaussian:
    """The Gaussian base ``p~`` of the prior over ``theta`` (the prior itself where it is one fixed
    Gaussian in the unconstrained space; see :func:`prior_correction` for the rest)."""
    means, covs = [], []
    for s in layout.sites:
        pair = s.gaussian if s.gaussian is not None else s.base
        assert pair is not None  # from_trace gives every corrected site a base
        mean, cov = pair
        if family == "meanfield" and cov.ndim == 2:
            cov = torch.diagonal(cov)
        means.append(mean)
        covs.append(cov)
    mean = torch.cat(means)
    if family == "meanfield":
        return DiagGaussian.from_moments(mean, torch.cat(covs))
    cov = torch.block_diag(*[c if c.ndim == 2 else torch.diag(c) for c in covs])
    return FullGaussian.from_moments(mean, cov)


def meanfield_corrected(layout: SiteLayout) -> tuple[str, ...]:
    """Sites with a correlated Gaussian prior (corrected under ``family='meanfield'``)."""
    return tuple(s.name for s in layout.sites
                 if s.gaussian is not None and s.gaussian[1].ndim == 2
                 and not torch.allclose(s.gaussian[1], torch.diag(torch.diagonal(s.gaussian[1]))))


def prior_correction(model: Callable, layout: SiteLayout, family: str, args: tuple,
                     kwargs: dict) -> Callable[[Tensor], Tensor] | None:
    """``theta -> log p(theta) + log|J(theta)| - log p~(theta)`` over the corrected sites, plus
    every ``pyro.factor`` outside all plates (a term of the prior, counted once); None when there
    is nothing to correct. ``log p`` is read from the model run at the global sites' values, so a
    prior whose parameters are other latent sites is evaluated exactly."""
    names = set(layout.corrected)
    if family == "meanfield":
        names |= set(meanfield_corrected(layout))
    tr = trace(model, args, kwargs)
    factors = [n for n, site in nodes(tr).items() if is_prior_factor(site)]
    if not names and not factors:
        return None
    sites = [s for s in layout.sites if s.name in names]

    def correction(theta: Tensor) -> Tensor:
        values = layout.constrain(theta)
        with using(layout.dtype):
            t = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
        total = torch.zeros((), dtype=layout.dtype)
        for s in sites:
            u = theta[s.slice]
            value = values[s.name]
            ladj = s.transform.log_abs_det_jacobian(u.reshape(s.unconstrained_shape), value)
            pair = s.gaussian if s.gaussian is not None else s.base
            assert pair is not None
            m, v = pair[0], (torch.diagonal(pair[1]) if pair[1].ndim == 2 else pair[1])
            log_base = -0.5 * torch.sum((u - m) ** 2 / v + torch.log(2 * math.pi * v))
            total = total + nodes(t)[s.name]["fn"].log_prob(value).sum() + ladj.sum() - log_base
        for n in factors:
            total = total + nodes(t)[n]["fn"].log_prob(nodes(t)[n]["value"]).sum()
        return total.to(layout.dtype)

    return correction


def innermost(fn: dist.Distribution) -> dist.Distribution:
    """The distribution inside any ``expand`` / ``to_event`` wrappers."""
    while isinstance(fn, (torch.distributions.Independent, dist.ExpandedDistribution)):
        fn = fn.base_dist
    return fn


def curvature(layout: SiteLayout) -> str:
    """``"stein"`` (curvature from gradients) when a corrected site's prior has a kink (Laplace),
    else ``"pointwise"``."""
    if any(s.name in layout.corrected and isinstance(innermost(s.prior), dist.Laplace)
           for s in layout.sites):
        return "stein"
    return "pointwise"


def is_prior_factor(site: dict) -> bool:
    """A ``pyro.factor`` in no plate: a term of the prior, counted once (by the server)."""
    return (site["type"] == "sample" and bool(site["is_observed"])
            and isinstance(site["fn"], dist.Unit) and not site["cond_indep_stack"])


def simplify(t: T.Transform) -> T.Transform:
    """``t`` without unit affine steps (torch maps ``greater_than(0)`` by ``exp`` then ``x + 0``),
    so that a positive site's map is ``ExpTransform`` as in NumPyro."""
    if isinstance(t, T.IndependentTransform):
        return T.IndependentTransform(simplify(t.base_transform), t.reinterpreted_batch_ndims)
    if isinstance(t, T.ComposeTransform):
        parts = [p for p in (simplify(p) for p in t.parts) if not _unit_affine(p)]
        return parts[0] if len(parts) == 1 else T.ComposeTransform(parts)
    return t


def _unit_affine(t: T.Transform) -> bool:
    if not isinstance(t, T.AffineTransform):
        return False
    loc, scale = torch.as_tensor(t.loc), torch.as_tensor(t.scale)
    return bool((loc == 0).all() and (scale == 1).all())


def base_transform(t: T.Transform) -> T.Transform:
    """The elementwise transform inside any ``IndependentTransform`` wrappers."""
    while isinstance(t, T.IndependentTransform):
        t = t.base_transform
    return t


def is_identity(t: T.Transform) -> bool:
    b = base_transform(t)
    return isinstance(b, T.ComposeTransform) and not b.parts


def _fixed_gaussian(fn: dist.Distribution, transform: T.Transform, shape: tuple
                    ) -> tuple[Tensor, Tensor] | None:
    """Flat mean and covariance (or variance vector) of a prior that is one Gaussian in the
    unconstrained space, or None."""
    fn = innermost(fn)
    size = torch.Size(shape)
    if (isinstance(fn, torch.distributions.TransformedDistribution) and len(fn.transforms) == 1
            and isinstance(fn.transforms[0], T.ExpTransform)):  # LogNormal
        base = innermost(fn.base_dist)
        if isinstance(base_transform(transform), T.ExpTransform) and isinstance(
                base, torch.distributions.Normal):
            return (base.loc.expand(size).reshape(-1).detach(),
                    (base.scale**2).expand(size).reshape(-1).detach())
        return None
    if isinstance(fn, torch.distributions.Normal) and is_identity(transform):
        return (fn.loc.expand(size).reshape(-1).detach(),
                (fn.scale**2).expand(size).reshape(-1).detach())
    if isinstance(fn, torch.distributions.MultivariateNormal) and is_identity(transform):
        d = fn.event_shape[-1]
        rows = math.prod(shape[:-1])
        loc = fn.loc.expand(size).reshape(-1).detach()
        cov = fn.covariance_matrix.expand((*shape[:-1], d, d)).reshape(rows, d, d).detach()
        return loc, torch.block_diag(*cov) if rows > 1 else cov[0]
    return None
