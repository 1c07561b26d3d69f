"""The global latent sites of a NumPyro model, flattened into one unconstrained vector.

:class:`SiteLayout` is what the cavity handler and the PVI guide agree on: for each global site
its name, constrained shape, the bijection from the unconstrained space (``biject_to(support)``,
as AutoNormal uses) and its slice of the flat vector ``theta``. :func:`classify` splits a model's
latent sites into global and local (per-client) ones.

Priors enter exactly. :func:`prior_factor` gives a Gaussian base ``p~`` over ``theta``: the prior
itself where it is one fixed Gaussian in the unconstrained space, a Gaussian fitted to prior draws
elsewhere (HalfCauchy, Gamma, Laplace, Dirichlet, LKJ, priors whose parameters are other latent
sites). :func:`prior_correction` is the rest, ``log p(theta) + log|J| - log p~(theta)``, which PVI's
server folds into one more factor ``t_0`` of ``q = p~ t_0 prod_k t_k``.

Example::

    >>> import jax.numpy as jnp, numpy as np
    >>> from fedppl.models import linear_regression as model
    >>> layout = SiteLayout.from_model(model, np.zeros((5, 2)), np.zeros(5))  # trace once
    >>> theta = jnp.zeros(layout.dim)
    >>> {k: v.shape for k, v in layout.constrain(theta).items()}
    {'w': (2,), 'b': ()}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import Array
from numpyro import handlers
from numpyro.distributions.transforms import IdentityTransform, Transform, biject_to

from fedppl.families.gaussian import DiagGaussian, FullGaussian, Gaussian
from fedppl.model_call import arg_names, model_error, positional

__all__ = ["Site", "SiteLayout", "classify", "prior_factor", "prior_correction", "curvature",
           "float_dtype", "cast_floats", "check_observations"]

BASE_DRAWS = 512  # prior draws that place the Gaussian base of a corrected site


@dataclass(frozen=True)
class Site:
    name: str
    shape: tuple[int, ...]  # constrained shape of one draw
    unconstrained_shape: tuple[int, ...]
    transform: Transform
    start: int
    size: int  # number of unconstrained coordinates
    prior: dist.Distribution  # the model's prior at this site (as traced)
    # (mean, covariance or variance vector) when the prior is one fixed Gaussian over the
    # unconstrained coordinates, else None (a corrected site)
    gaussian: tuple[Array, Array] | None = None
    # a corrected site's Gaussian base (mean, variance vector)
    base: tuple[Array, Array] | None = None

    @property
    def slice(self) -> slice:
        return slice(self.start, self.start + self.size)


@dataclass(frozen=True)
class SiteLayout:
    """Ordered global latent sites and their place in the flat unconstrained vector.

    ``dtype`` is the floating dtype ``theta`` (and so the guide, its factors and the prior's
    Gaussian base) computes in; None (the default) fixes it, when the layout is made, to JAX's
    default float: float64 under ``jax_enable_x64``, else float32 (see :func:`float_dtype`).
    """

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
    def from_model(
        cls,
        model: Callable,
        *args: Any,
        global_sites: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> SiteLayout:
        """Trace ``model(*args, **kwargs)`` once and lay out its global latent sites.

        ``global_sites=None`` takes every latent sample site. Named sites that the model does
        not have, or latent sites left out of ``global_sites``, raise a ``ValueError`` (use
        :func:`classify` to split a model's sites into global and local ones).
        """
        model = positional(model)
        tr, names, local = classify(model, args, kwargs, global_sites, None)
        if local:
            raise ValueError(
                f"latent sites {local} are not in global_sites; a SiteLayout holds global sites "
                "only (PVIGuide treats the others as local sites of each client)"
            )
        return cls.from_trace(model, args, kwargs, tr, names)

    @classmethod
    def from_trace(cls, model: Callable, args: tuple, kwargs: dict, tr: dict,
                   names: Sequence[str], priors: bool = True, dtype: Any = None) -> SiteLayout:
        """Lay out the sites ``names`` of the trace ``tr`` of ``model(*args, **kwargs)``; with
        ``priors``, sites whose prior is not one fixed Gaussian in the unconstrained space get a
        Gaussian base (see :func:`prior_factor`) from prior draws (local sites need none: their
        priors are part of each client's likelihood). The priors' Gaussians and bases are kept
        in the layout's ``dtype`` (see :class:`SiteLayout`)."""
        dtype = float_dtype(dtype)
        dependent = (_dependent_sites(model, args, kwargs, tr, names) if priors
                     else set(names))
        sites, start = [], 0
        for name in names:
            site = tr[name]
            fn = site["fn"]
            shape = tuple(jnp.shape(site["value"]))
            try:
                transform = biject_to(fn.support)
            except NotImplementedError as e:
                raise ValueError(
                    f"latent site '{name}' has support {fn.support}, which numpyro cannot map to "
                    "an unconstrained space (no biject_to); give it a prior with a supported "
                    "support or make it observed"
                ) from e
            ushape = tuple(transform.inverse_shape(shape))
            size = int(math.prod(ushape))
            gaussian = (None if name in dependent
                        else _fixed_gaussian(fn, transform, shape, name))
            if gaussian is not None:  # a prior of Python floats is float64 under x64
                mean, cov = gaussian
                gaussian = (jnp.asarray(mean, dtype), jnp.asarray(cov, dtype))
            sites.append(Site(name, shape, ushape, transform, start, size, fn, gaussian))
            start += size
        layout = cls(tuple(sites), dtype)
        if priors and layout.corrected:
            layout = layout._with_bases(model, args, kwargs)
        return layout

    @property
    def corrected(self) -> tuple[str, ...]:
        """Sites whose prior is not one fixed Gaussian over their unconstrained coordinates: the
        prior factor corrects the Gaussian base for them (:func:`prior_correction`)."""
        return tuple(s.name for s in self.sites if s.gaussian is None)

    def _with_bases(self, model: Callable, args: tuple, kwargs: dict) -> SiteLayout:
        """Give each corrected site a diagonal Gaussian base from the prior's draws (median and
        interquartile range of the unconstrained coordinates, a robust stand-in for moments that
        heavy tails such as HalfCauchy's do not spoil)."""
        names = self.corrected

        def draw(key):
            tr = handlers.trace(handlers.seed(model, key)).get_trace(*args, **kwargs)
            return {n: jnp.reshape(self[n].transform.inv(tr[n]["value"]), (-1,)) for n in names}

        try:
            # compiled once (an eager vmap compiles every operation of the model by itself)
            draws = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(0), BASE_DRAWS))
        except Exception:  # a model that cannot be vmapped: draw one by one
            keys = jax.random.split(jax.random.key(0), BASE_DRAWS)
            parts = [draw(k) for k in keys]
            draws = {n: jnp.stack([p[n] for p in parts]) for n in names}
        sites = []
        for s in self.sites:
            if s.gaussian is None:
                u = np.asarray(draws[s.name], dtype=float)
                u = np.where(np.isfinite(u), u, np.nan)
                loc = np.nan_to_num(np.nanmedian(u, axis=0))
                q25, q75 = np.nanpercentile(u, [25, 75], axis=0)
                sd = np.clip(np.nan_to_num((q75 - q25) / 1.349, nan=1.0), 1e-3, 1e3)
                # NumPy statistics are float64: the base is kept in the layout's dtype
                s = Site(s.name, s.shape, s.unconstrained_shape, s.transform, s.start, s.size,
                         s.prior, None, (jnp.asarray(loc, self.dtype),
                                         jnp.asarray(sd**2, self.dtype)))
            sites.append(s)
        return SiteLayout(tuple(sites), self.dtype)

    # -- moving between the flat vector and per-site values ------------------------------------

    def unpack(self, theta: Array) -> dict[str, Array]:
        """Unconstrained per-site values from ``theta`` of shape ``(..., dim)``."""
        lead = theta.shape[:-1]
        return {s.name: theta[..., s.slice].reshape(lead + s.unconstrained_shape)
                for s in self.sites}

    def constrain(self, theta: Array) -> dict[str, Array]:
        """Constrained per-site values (in the model's support) from ``theta``."""
        values = self.unpack(theta).values()
        return {s.name: s.transform(u) for s, u in zip(self.sites, values, strict=True)}

    def unconstrain(self, values: dict[str, Array]) -> Array:
        """The flat unconstrained vector from constrained per-site values (no leading axes)."""
        parts = [jnp.reshape(s.transform.inv(values[s.name]), (-1,)) for s in self.sites]
        return jnp.concatenate(parts)

    def log_abs_det_jacobian(self, theta: Array) -> Array:
        """Sum over sites of ``log |d constrain / d theta|`` (no leading axes)."""
        total: Array | float = 0.0
        for s, u in zip(self.sites, self.unpack(theta).values(), strict=True):
            ladj = s.transform.log_abs_det_jacobian(u, s.transform(u))
            total = total + jnp.sum(ladj)
        return jnp.asarray(total)

    def site_distribution(self, name: str, mean: Array, cov: Array, diag: bool
                          ) -> dist.Distribution:
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


def float_dtype(dtype: Any = None) -> np.dtype:
    """``dtype`` as JAX will compute in it (float64 becomes float32 without x64); None gives
    JAX's default float (float64 under ``jax_enable_x64``, else float32)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(jnp.float64 if dtype is None else dtype))


def cast_floats(arrays: Sequence[Any], dtype: Any) -> tuple:
    """``arrays`` with the floating ones cast to ``dtype`` (integer, boolean and other arrays,
    and non-arrays, as they are): a model's data in the dtype ``theta`` computes in, so that
    float32 data do not meet a float64 ``theta`` or the other way round."""
    out = []
    for a in arrays:
        kind = getattr(a, "dtype", None)
        if kind is not None and jnp.issubdtype(kind, jnp.floating) and kind != dtype:
            a = jnp.asarray(a, dtype)
        out.append(a)
    return tuple(out)


def classify(model: Callable, args: tuple, kwargs: dict,
             global_sites: Sequence[str] | None, local_sites: Sequence[str] | None
             ) -> tuple[dict, list[str], list[str]]:
    """Trace ``model(*args, **kwargs)`` and split its latent sites into global and local ones.

    ``global_sites`` given: the other latent sites are local; ``local_sites`` given: the others
    are global; neither: every latent site is global. Returns the trace and the two name lists
    (in the model's order). Unknown names, discrete latent sites and local sites inside the data
    plate raise a ``ValueError`` naming the site.
    """
    model = positional(model)
    try:
        tr = handlers.trace(handlers.seed(model, 0)).get_trace(*args, **kwargs)
    except Exception as err:  # the model's own error, with the shapes of what it was given
        raise model_error(err, model, args, kwargs) from err
    check_observations(model, tr, args)
    latent = [
        name for name, site in tr.items()
        if site["type"] == "sample" and not site["is_observed"]
        and not site["infer"].get("is_auxiliary", False)
    ]
    for name in latent:
        support = tr[name]["fn"].support
        if getattr(support, "is_discrete", False):
            raise ValueError(
                f"latent site '{name}' is discrete ({type(tr[name]['fn']).__name__}); fedppl's "
                "guides are Gaussian over continuous sites. Marginalise it out (sum it out in "
                "the likelihood, e.g. with dist.MixtureSameFamily, or with numpyro's "
                "enumeration), or make it observed"
            )
    for which, given in (("global_sites", global_sites), ("local_sites", local_sites)):
        if given is not None:
            missing = [n for n in given if n not in latent]
            if missing:
                raise ValueError(
                    f"{which} names {missing}, which the model does not have as latent sample "
                    f"sites; its latent sites are {latent}"
                )
    if global_sites is not None and local_sites is not None:
        both = set(global_sites) & set(local_sites)
        left = [n for n in latent if n not in global_sites and n not in local_sites]
        if both or left:
            raise ValueError(
                f"global_sites and local_sites must split the latent sites {latent}: "
                f"{sorted(both)} are in both, {left} in neither"
            )
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
        plates = [f for f in tr[name]["cond_indep_stack"] if f.size in sizes]
        if plates:
            raise ValueError(
                f"local site '{name}' sits in the plate '{plates[0].name}' over the data points "
                "(one latent value per data point); fedppl's local sites are per-client or "
                "per-group quantities: put it in a plate over groups, or marginalise it out"
            )
    return tr, names, local


# -- the model's data arguments -------------------------------------------------------------------


def check_observations(model: Callable, tr: dict, args: tuple) -> None:
    """Refuse, before anything is compiled, observed sites that do not split over clients.

    The data plates are the plates whose (full) size is the leading size of a data argument.
    Refused, each with a ``ValueError`` naming the site (and the argument it observes):

    * an observed value whose shape does not fit its distribution, so that numpyro would
      broadcast them (``y`` of shape ``(N, 1)`` against a distribution of shape ``(N,)`` scores
      every point against every other point's likelihood);
    * one distribution over the whole data axis (an exact GP's ``MultivariateNormal`` over all
      N points): it couples every data point, so it does not split over clients; inside a data
      plate it becomes N copies of itself, another model.

    Other observations outside the data plate are refused by :class:`fedppl.handlers.client`.
    """
    sizes = {int(np.shape(a)[0]) for a in args if np.ndim(a) > 0}
    if not sizes:
        return
    data_plates = {name for name, site in tr.items()
                   if site["type"] == "plate" and int(site["args"][0]) in sizes}
    names = arg_names(model, len(args))
    for name, site in tr.items():
        if site["type"] != "sample" or not site["is_observed"] or is_prior_factor(site):
            continue
        fn, value = site["fn"], site["value"]
        obs = tuple(np.shape(value))
        shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
        which = next((f" (the model's argument {n})" for n, a in zip(names, args, strict=True)
                      if a is value), "")
        joint = [d for d in innermost(fn).event_shape if d in sizes]
        in_plate = any(f.name in data_plates for f in site["cond_indep_stack"])
        if joint and (not in_plate or obs != shape):
            n = joint[0]
            copies = (f"Inside the data plate it is {n} copies of that likelihood, each scoring "
                      "all the points: a different model" if in_plate else
                      f"Putting it inside numpyro.plate('data', N) would not help: that makes {n} "
                      "copies of it, a different model")
            raise ValueError(
                f"observed site '{name}'{which} is one {type(innermost(fn)).__name__} over all "
                f"{n} data points (event shape {tuple(fn.event_shape)}): this likelihood couples "
                "every data point, so it does not split over clients (a client's log-likelihood "
                f"is not a sum over its own points). {copies}. For a federated GP use the "
                "sparse GPs: fedppl.FederatedSGP or fedppl.FSGP"
            )
        try:
            grown = tuple(np.broadcast_shapes(obs, shape)) != shape
        except ValueError:
            grown = True
        if grown:
            hint = ""
            if obs[-1:] == (1,) and obs[:-1] == shape:
                arg = which[len(" (the model's argument "):-1] if which else "the observed array"
                hint = f"; pass {arg} of shape {shape} ({arg}.reshape(-1) or {arg}[:, 0])"
            raise ValueError(
                f"observed site '{name}'{which} has shape {obs} but its distribution has shape "
                f"{shape}: numpyro would broadcast them, scoring each data point against every "
                f"other point's likelihood{hint}"
            )


def _dependent_sites(model: Callable, args: tuple, kwargs: dict, tr: dict,
                     names: Sequence[str]) -> set[str]:
    """The sites among ``names`` whose prior changes with the values of other latent sites.

    Such a prior (``Normal(mu, tau)`` with ``mu`` and ``tau`` latent) is not one Gaussian over
    the unconstrained sites; read from one trace it would be a Gaussian at one random draw of
    ``mu`` and ``tau``. A second trace with other values shows the dependence, and those sites
    go through the prior factor with their exact conditional density.
    """
    other = handlers.trace(handlers.seed(model, 1)).get_trace(*args, **kwargs)
    out = set()
    for name in names:
        try:
            a = jax.tree_util.tree_leaves(tr[name]["fn"])
            b = jax.tree_util.tree_leaves(other[name]["fn"])
        except (KeyError, TypeError, NotImplementedError):  # not a pytree: assume dependent
            out.add(name)
            continue
        same = len(a) == len(b) and all(
            np.shape(x) == np.shape(y) and np.allclose(np.asarray(x), np.asarray(y))
            for x, y in zip(a, b, strict=True)
        )
        if not same:
            out.add(name)
    return out


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
    """The Gaussian base ``p~`` of the prior over ``theta``, of the requested family.

    A site whose prior is one fixed Gaussian in the unconstrained space (Normal,
    MultivariateNormal, LogNormal, and their ``expand``/``to_event`` forms) contributes that
    Gaussian exactly, and ``p~`` is then the prior itself. Any other site (a HalfCauchy, Gamma,
    Laplace, Dirichlet or LKJ prior, a prior whose parameters are other latent sites, a
    correlated prior under a mean-field family) contributes its base from
    :meth:`SiteLayout.from_trace`, and :func:`prior_correction` carries the difference.
    """
    means, covs = [], []
    for s in layout.sites:
        pair = s.gaussian if s.gaussian is not None else s.base
        assert pair is not None  # from_trace gives every corrected site a base
        mean, cov = pair
        if family == "meanfield" and cov.ndim == 2:
            cov = jnp.diag(cov)
        means.append(mean)
        covs.append(cov)
    mean = jnp.concatenate(means)
    if family == "meanfield":
        return DiagGaussian.from_moments(mean, jnp.concatenate(covs))
    cov = jax.scipy.linalg.block_diag(*[c if c.ndim == 2 else jnp.diag(c) for c in covs])
    return FullGaussian.from_moments(mean, cov)


def meanfield_corrected(layout: SiteLayout) -> tuple[str, ...]:
    """Sites with a correlated Gaussian prior: a mean-field base keeps only its diagonal, so they
    are corrected like non-Gaussian priors under ``family='meanfield'``."""
    return tuple(s.name for s in layout.sites
                 if s.gaussian is not None and s.gaussian[1].ndim == 2
                 and not np.allclose(s.gaussian[1], np.diag(np.diag(s.gaussian[1]))))


def prior_correction(model: Callable, layout: SiteLayout, family: str, args: tuple,
                     kwargs: dict) -> Callable[[Array], Array] | None:
    """``theta -> log p(theta) + log|J(theta)| - log p~(theta)`` over the corrected sites, plus
    every ``numpyro.factor`` outside all plates (a term of the prior, counted once); None when
    there is nothing to correct (``p~`` is the prior).

    ``log p`` is read from a trace of the model with the global sites substituted, so a prior
    whose parameters are other latent sites is evaluated exactly, conditional on their values.
    Under this correction ``p~(theta) exp(correction(theta))`` is the model's exact prior density
    over the unconstrained coordinates.
    """
    names = set(layout.corrected)
    if family == "meanfield":
        names |= set(meanfield_corrected(layout))
    tr = handlers.trace(handlers.seed(model, 0)).get_trace(*args, **kwargs)
    factors = [n for n, site in tr.items() if is_prior_factor(site)]
    if not names and not factors:
        return None
    sites = [s for s in layout.sites if s.name in names]

    def site_base(s: Site) -> tuple[Array, Array]:
        pair = s.gaussian if s.gaussian is not None else s.base
        assert pair is not None  # from_trace gives every corrected site a base
        m, c = pair
        return m, (jnp.diag(c) if c.ndim == 2 else c)

    def correction(theta: Array) -> Array:
        values = layout.constrain(theta)
        t = handlers.trace(handlers.substitute(handlers.seed(model, 0), data=values)).get_trace(
            *args, **kwargs)
        total: Array | float = 0.0
        for s in sites:
            u = theta[s.slice]
            value = values[s.name]
            ladj = s.transform.log_abs_det_jacobian(u.reshape(s.unconstrained_shape), value)
            m, v = site_base(s)
            log_base = -0.5 * jnp.sum((u - m) ** 2 / v + jnp.log(2 * jnp.pi * v))
            total = total + jnp.sum(t[s.name]["fn"].log_prob(value)) + jnp.sum(ladj) - log_base
        for n in factors:
            total = total + jnp.sum(t[n]["fn"].log_prob(t[n]["value"]))
        # in the layout's dtype: numpyro may compute a prior density in float64 under x64 (a
        # Python-float parameter next to an array one becomes a float64 NumPy array)
        return jnp.asarray(total, layout.dtype)

    return correction


def innermost(fn: dist.Distribution) -> dist.Distribution:
    """The distribution inside any ``expand`` / ``to_event`` wrappers."""
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
        fn = fn.base_dist
    return fn


def curvature(layout: SiteLayout) -> str:
    """How the prior correction's curvature is estimated: from gradients (``"stein"``) when a
    corrected site's prior has a kink (Laplace: its pointwise Hessian is zero almost everywhere),
    else from pointwise Hessians."""
    kinked = (dist.Laplace, dist.AsymmetricLaplace)
    if any(s.name in layout.corrected and isinstance(innermost(s.prior), kinked)
           for s in layout.sites):
        return "stein"
    return "pointwise"


def is_prior_factor(site: dict) -> bool:
    """A ``numpyro.factor`` in no plate: a term of the prior, counted once (by the server)."""
    return (site["type"] == "sample" and site["is_observed"]
            and isinstance(site["fn"], dist.Unit) and not site["cond_indep_stack"])


def base_transform(t: Transform) -> Transform:
    """The elementwise transform inside any ``IndependentTransform`` wrappers."""
    while isinstance(t, dist.transforms.IndependentTransform):
        t = t.base_transform
    return t


def is_identity(t: Transform) -> bool:
    return isinstance(base_transform(t), IdentityTransform)


def _fixed_gaussian(fn: dist.Distribution, transform: Transform, shape: tuple,
                    name: str) -> tuple[Array, Array] | None:
    """Flat mean and covariance (or variance vector) of a prior that is one Gaussian in the
    unconstrained space, or None."""
    fn = innermost(fn)
    if isinstance(fn, dist.Normal) and is_identity(transform):
        loc = jnp.broadcast_to(fn.loc, shape).reshape(-1)
        var = jnp.broadcast_to(fn.scale**2, shape).reshape(-1)
        return loc, var
    if isinstance(fn, dist.LogNormal) or (
        isinstance(fn, dist.TransformedDistribution)
        and isinstance(fn.base_dist, dist.Normal)
        and len(fn.transforms) == 1
        and isinstance(fn.transforms[0], dist.transforms.ExpTransform)
    ):
        base = innermost(fn.base_dist)
        if isinstance(base_transform(transform), dist.transforms.ExpTransform):
            loc = jnp.broadcast_to(base.loc, shape).reshape(-1)
            var = jnp.broadcast_to(base.scale**2, shape).reshape(-1)
            return loc, var
    if isinstance(fn, dist.MultivariateNormal) and is_identity(transform):
        # rows of the site are independent draws: a block-diagonal covariance
        d = fn.event_shape[-1]
        rows = math.prod(shape[:-1])
        loc = jnp.broadcast_to(fn.loc, shape).reshape(-1)
        cov = jnp.broadcast_to(fn.covariance_matrix, (*shape[:-1], d, d)).reshape(rows, d, d)
        return loc, jax.scipy.linalg.block_diag(*cov) if rows > 1 else cov[0]
    return None
