"""``PVIGuide``: a Gaussian guide over a model's global sites, shaped as prior x client factors.

q(theta) = p(theta) * prod_k t_k(theta) lives in the unconstrained space of the global sites
(``p`` is the prior's Gaussian base times the server's prior factor when the prior is not
Gaussian there; see :mod:`fedppl.sites`). Local sites (a client's random effects) get a private
conditional guide ``q(z_k | theta)`` at each client
(:class:`~fedppl.families.gaussian.Conditional`).
Constrained sites go through ``biject_to(support)``, as with AutoNormal. The guide is an ordinary
NumPyro guide whose parameters are q's mean and scale (``pvi_loc``, ``pvi_scale_raw``); PVI reads
and writes q through :meth:`PVIGuide.params_from` and :meth:`PVIGuide.q_from`, and keeps the
factors themselves in natural parameters (:mod:`fedppl.families.gaussian`).

Example::

    >>> import jax, numpy as np
    >>> from fedppl.models import linear_regression as model
    >>> X, y = np.zeros((5, 2)), np.zeros(5)
    >>> guide = PVIGuide(model, family="fullrank")
    >>> guide = guide.setup(X, y)                  # trace once: sites, shapes, the prior
    >>> params = guide.params_from(guide.prior)    # q = prior
    >>> guide.sample(jax.random.key(0), guide.prior, 100)["w"].shape
    (100, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array

from fedppl.families import gaussian as g
from fedppl.model_call import positional
from fedppl.sites import SiteLayout, classify, float_dtype, prior_correction, prior_factor

__all__ = ["PVIGuide"]

FAMILIES = ("meanfield", "fullrank")
LOCAL = ("joint", "independent")


class PVIGuide:
    """Gaussian guide over the global latent sites of ``model`` (see
    :mod:`fedppl.guides.pvi_guide`).

    :param model: a NumPyro model.
    :param global_sites: names of the global latent sites; the model's other latent sites are
        then local to each client. Default: every latent site is global (unless ``local_sites``
        names some).
    :param family: ``"meanfield"`` (diagonal factors) or ``"fullrank"`` (one joint Gaussian).
    :param local_sites: names of the local latent sites (per-client or per-group quantities such
        as random effects, in a plate over groups); an alternative to ``global_sites``.
    :param local: how a client's private guide over its local sites ``z_k`` relates to the
        global sites ``theta``. ``"joint"`` (default): one full Gaussian over ``(theta, z_k)``
        at the client, whose marginal over ``theta`` makes its factor (moment-projected to a
        diagonal one for ``family="meanfield"``); exact for a conjugate model, at a cost of
        ``O((D + d)^3)`` per local iteration for ``D`` global and ``d`` local coordinates.
        ``"independent"``: ``q(theta) q(z_k)`` with ``q(z_k)`` diagonal, like numpyro's
        ``AutoNormal``; cheaper (``D^3 + d`` for full rank, ``D + d`` mean-field) but it ignores
        the posterior correlation between the two, so the global sites' variance comes out too
        small, even for a Gaussian model.
    :param dtype: the floating dtype q, the factors and the local steps compute in (the model's
        floating data are cast to it). Default: JAX's default float at :meth:`setup`, float64
        under ``jax_enable_x64`` and float32 without; ``jnp.float32`` runs PVI in float32 in an
        x64 process too.
    """

    def __init__(self, model: Callable, global_sites: Sequence[str] | None = None,
                 family: str = "meanfield", *, local_sites: Sequence[str] | None = None,
                 local: str = "joint", dtype: Any = None):
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        if local not in LOCAL:
            raise ValueError(f"local must be one of {LOCAL}, got {local!r}")
        self.model = positional(model)  # data arguments may be keyword-only
        self.global_sites = None if global_sites is None else tuple(global_sites)
        self.local_sites = None if local_sites is None else tuple(local_sites)
        self.family = family
        self.local = local
        self.dtype = dtype
        self.layout: SiteLayout | None = None
        self.local_layout: SiteLayout | None = None
        self.prior: g.Gaussian | None = None
        self.prior_correction: Callable[[Array], Array] | None = None
        self._signature: tuple[Any, ...] | None = None

    @property
    def diag(self) -> bool:
        return self.family == "meanfield"

    @property
    def client_diag(self) -> bool:
        """Whether a client's joint over ``(theta, z_k)`` is a diagonal Gaussian."""
        return self.diag and (self.local_layout is None or self.local == "independent")

    @property
    def key(self) -> tuple:
        """What makes two guides the same guide: the model, the choice of sites, the family,
        ``local``, the dtype and, once set up, the prototype's shapes and keyword arguments and
        the prior's values. Equal guides (``==``, and the same ``hash``) share compiled rounds
        (:mod:`fedppl.infer.variational`); a later :meth:`setup` on other shapes changes it."""
        prior = None if self.prior is None else (type(self.prior).__name__, tuple(
            (np.shape(x), str(np.asarray(x).dtype), np.asarray(x).tobytes())
            for x in jax.tree_util.tree_leaves(self.prior)))
        return (type(self), self.model, self.global_sites, self.local_sites, self.family,
                self.local, self.dtype, self._signature, prior)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, PVIGuide) and self.key == other.key)

    def __hash__(self) -> int:
        return hash(self.key)

    def setup(self, *args: Any, **kwargs: Any) -> PVIGuide:
        """Trace the model on prototype data (one client's arrays) to find the global and local
        sites, the prior's Gaussian base and its correction (again only when the arrays' shapes or
        the keyword arguments change: GlobalVI's pooled data may have more groups)."""
        dtype = float_dtype(self.dtype)
        args = tuple(jnp.asarray(a) for a in args)  # traced inside compiled rounds later
        signature = (tuple(jnp.shape(a) for a in args), repr(sorted(kwargs.items())), dtype)
        if self.layout is None or signature != self._signature:
            self._signature = signature
            tr, names, local = classify(self.model, args, kwargs, self.global_sites,
                                        self.local_sites)
            if not names:
                raise ValueError("every latent site is local; PVI needs at least one global site "
                                 "(name them in global_sites)")
            self.layout = SiteLayout.from_trace(self.model, args, kwargs, tr, names, dtype=dtype)
            self.local_layout = (SiteLayout.from_trace(self.model, args, kwargs, tr, local,
                                                       priors=False, dtype=dtype)
                                 if local else None)
            self.prior = g.strong(prior_factor(self.layout, self.family))
            self.prior_correction = prior_correction(self.model, self.layout, self.family, args,
                                                     kwargs)
        return self

    def roles(self) -> dict[str, list[str]]:
        """The latent sites this guide treats as global (in ``q``, sent as factors) and as
        local (each client's own, never sent), as :meth:`setup` found them."""
        layout = self.layout_or_raise()
        local = [] if self.local_layout is None else list(self.local_layout.names)
        return {"global_sites": list(layout.names), "local_sites": local}

    def describe(self) -> str:
        """One line on the sites' roles, for a run's first progress line."""
        def listed(layout: SiteLayout) -> str:
            return ", ".join(s.name + (f" {list(s.shape)}" if s.shape else "")
                             for s in layout.sites)

        layout = self.layout_or_raise()
        line = f"global sites {listed(layout)}"
        if self.local_layout is None:
            default = self.global_sites is None and self.local_sites is None
            return line + (" (every latent site, the default)" if default else "")
        return line + f"; local to each client: {listed(self.local_layout)}"

    def structure(self) -> Array | None:
        """For ``family="fullrank", local="independent"``: the precision entries a client's
        joint may have (the global and local blocks, no coupling); else None."""
        if self.local_layout is None or self.local != "independent" or self.diag:
            return None
        D, d = self.layout_or_raise().dim, self.local_layout.dim
        top = jnp.concatenate([jnp.ones((D, D), bool), jnp.zeros((D, d), bool)], 1)
        bottom = jnp.concatenate([jnp.zeros((d, D), bool), jnp.eye(d, dtype=bool)], 1)
        return jnp.concatenate([top, bottom], 0)

    def init_local(self, dtype=None) -> g.Conditional | None:
        """A client's first private guide: ``z_k ~ N(0, I)`` in the unconstrained space,
        independent of ``theta`` (None without local sites)."""
        if self.local_layout is None:
            return None
        D, d = self.layout_or_raise().dim, self.local_layout.dim
        dtype = dtype or self.prior_or_raise().nat1.dtype
        return g.Conditional(jnp.zeros(d, dtype), jnp.eye(d, dtype=dtype),
                             jnp.zeros((d, D), dtype))

    def layout_or_raise(self) -> SiteLayout:
        """The site layout :meth:`setup` found; a ``RuntimeError`` before it."""
        if self.layout is None:
            raise RuntimeError("call guide.setup(*model_args) first (PVI.run does this)")
        return self.layout

    @property
    def signature(self) -> tuple[Any, ...] | None:
        """The shapes, static keyword arguments and dtype the guide was set up with (None
        before :meth:`setup`)."""
        return self._signature

    def prior_or_raise(self) -> g.Gaussian:
        """The prior's Gaussian base :meth:`setup` found; a ``RuntimeError`` before it."""
        self.layout_or_raise()
        assert self.prior is not None  # set by setup together with the layout
        return self.prior

    # -- the NumPyro guide ---------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """The guide over the global sites as a NumPyro guide (for ``Trace_ELBO`` and the
        ``cavity`` handler); local sites are not in it, so under a NumPyro ELBO they would be
        drawn from their prior. PVI itself does not call it."""
        layout = self.layout_or_raise()
        init = self.params_from(self.prior_or_raise())
        loc = numpyro.param("pvi_loc", init["pvi_loc"])
        raw = numpyro.param("pvi_scale_raw", init["pvi_scale_raw"])
        theta = numpyro.sample("_pvi_theta", self._base(loc, raw), infer={"is_auxiliary": True})
        for site, u in zip(layout.sites, layout.unpack(theta).values(), strict=True):
            value = site.transform(u)
            ladj = jnp.sum(site.transform.log_abs_det_jacobian(u, value))
            numpyro.sample(site.name, dist.Delta(value, -ladj, event_dim=len(site.shape)))

    def _base(self, loc: Array, raw: Array) -> dist.Distribution:
        if self.diag:
            return dist.Normal(loc, jnp.exp(raw)).to_event(1)
        return dist.MultivariateNormal(loc, scale_tril=_tril_from_raw(raw))

    # -- between q (natural parameters) and the guide's parameters --------------------------------

    def params_from(self, q: g.Gaussian) -> dict[str, Array]:
        """Guide parameters (mean and raw scale) that represent ``q``."""
        mean, sc = g.mean_and_scale_tril(q)
        if self.diag:
            return {"pvi_loc": mean, "pvi_scale_raw": jnp.log(sc)}
        diag = jnp.diagonal(sc, axis1=-2, axis2=-1)
        eye = jnp.eye(sc.shape[-1], dtype=sc.dtype)  # not the default float: no float64 upcast
        raw = jnp.tril(sc, -1) + jnp.einsum("...i,ij->...ij", jnp.log(diag), eye)
        return {"pvi_loc": mean, "pvi_scale_raw": raw}

    def mean_and_tril(self, params: dict[str, Array]) -> tuple[Array, Array]:
        """q's mean and scale (a std vector for mean-field, else the lower Cholesky factor)."""
        loc, raw = params["pvi_loc"], params["pvi_scale_raw"]
        return loc, (jnp.exp(raw) if self.diag else _tril_from_raw(raw))

    def q_from(self, params: dict[str, Array]) -> g.Gaussian:
        """The Gaussian (natural parameters) that the guide parameters describe."""
        loc, raw = params["pvi_loc"], params["pvi_scale_raw"]
        if self.diag:
            return g.DiagGaussian.from_moments(loc, jnp.exp(2 * raw))
        tril = _tril_from_raw(raw)
        # precision = L^-T L^-1 without forming the covariance
        eye = jnp.eye(loc.shape[-1], dtype=loc.dtype)
        linv = jax.scipy.linalg.solve_triangular(tril, eye, lower=True)
        prec = linv.T @ linv
        return g.FullGaussian(prec @ loc, 0.5 * (prec + prec.T))

    # -- reading a posterior -----------------------------------------------------------------------

    def posterior(self, q: g.Gaussian) -> dict[str, dist.Distribution]:
        """Per-site marginal distributions of ``q`` in the constrained space."""
        layout = self.layout_or_raise()
        mean, cov = g.to_moments(q)
        out = {}
        for s in layout.sites:
            block = cov[s.slice] if self.diag else cov[s.slice, s.slice]
            out[s.name] = layout.site_distribution(s.name, mean[s.slice], block, self.diag)
        return out

    def sample(self, rng_key: Array, q: g.Gaussian, num_samples: int,
               local: g.Conditional | None = None) -> dict[str, Array]:
        """Joint draws from ``q``, constrained, keyed by site: ``{name: (num_samples, *shape)}``.

        With ``local`` (a client's private guide, or the guides of several clients stacked on a
        leading axis) the local sites are drawn from it given each draw of ``theta`` and added,
        with that client axis after the draw axis."""
        layout = self.layout_or_raise()
        theta = g.sample(rng_key, q, num_samples)
        out = layout.constrain(theta)
        if local is not None:
            if self.local_layout is None:
                raise ValueError("local was given but the model has no local sites")
            key = jax.random.fold_in(rng_key, 1)
            if local.nat1.ndim == 1:
                z = _sample_conditional(key, local, theta)
            else:
                keys = jax.random.split(key, local.nat1.shape[0])
                z = jax.vmap(_sample_conditional, (0, 0, None), 1)(keys, local, theta)
            out.update(self.local_layout.constrain(z))
        return out


    def unheld_from_prior(self, rng_key: Array, draws: dict[str, Array], held: Array,
                          model: Callable, data: tuple) -> dict[str, Array]:
        """``draws`` (one client's, ``{name: (S, ...)}``; or several clients' with their axis
        after the draw axis and ``held`` stacked the same way) with the local coordinates a
        client holds no data for (``held`` False) drawn from the model's prior given each
        draw's other sites: p(z_j | theta), what the pooled posterior gives a group without
        data. The model runs on ``data`` (one client's arrays) for each draw."""
        loc = self.local_layout
        if loc is None:
            raise ValueError("the model has no local sites")
        if held.ndim == 2:  # several clients
            keys = jax.random.split(rng_key, held.shape[0])
            local = {s.name: draws[s.name] for s in loc.sites}
            shared = {k: v for k, v in draws.items() if k not in local}
            filled = jax.vmap(lambda key, z, h: self.unheld_from_prior(
                key, {**shared, **z}, h, model, data), (0, 1, 0), 1)(keys, local, held)
            return {**draws, **{s.name: filled[s.name] for s in loc.sites}}
        masks = {}
        for s in loc.sites:
            h = held[s.slice].reshape(s.unconstrained_shape)
            masks[s.name] = h if s.unconstrained_shape == s.shape else jnp.any(h)
        num = jax.tree_util.tree_leaves(draws)[0].shape[0]
        keys = jax.random.split(rng_key, num)
        fill = jax.jit(jax.vmap(lambda key, values, masks, data: _fill(key, values, masks,
                                                                        model, data),
                                (0, 0, None, None)))
        filled = fill(keys, draws, masks, tuple(jnp.asarray(a) for a in data))
        return {**draws, **filled}


def _fill(key: Array, values: dict[str, Array], masks: dict[str, Array], model: Callable,
          data: tuple) -> dict[str, Array]:
    """One draw's local sites where ``masks`` is False replaced by the model's prior draws
    given the other sites (``values``)."""
    from numpyro import handlers

    def value(msg):
        if msg["type"] != "sample" or msg["is_observed"]:
            return None
        if msg["name"] in masks:
            prior = msg["fn"](rng_key=msg["kwargs"]["rng_key"],
                              sample_shape=msg["kwargs"].get("sample_shape", ()))
            return jnp.where(masks[msg["name"]], values[msg["name"]], prior)
        return values.get(msg["name"])

    tr = handlers.trace(handlers.substitute(handlers.seed(model, key), substitute_fn=value)
                        ).get_trace(*data)
    return {name: tr[name]["value"] for name in masks}


def _sample_conditional(key: Array, c: g.Conditional, theta: Array) -> Array:
    """Draws of ``z ~ q(z | theta)`` for each row of ``theta``: mean ``C^-1 (h - B theta)``,
    covariance ``C^-1``."""
    chol = jnp.linalg.cholesky(c.prec)
    rhs = c.nat1 - theta @ c.cross.T
    mean = jax.scipy.linalg.cho_solve((chol, True), rhs.T).T
    eps = jax.random.normal(key, mean.shape, mean.dtype)
    return mean + jax.scipy.linalg.solve_triangular(chol.T, eps.T, lower=False).T


def _tril_from_raw(raw: Array) -> Array:
    """Lower-triangular scale with a positive diagonal from an unconstrained square matrix."""
    diag = jnp.exp(jnp.diagonal(raw, axis1=-2, axis2=-1))
    return jnp.tril(raw, -1) + diag[..., None] * jnp.eye(raw.shape[-1], dtype=raw.dtype)
