"""``PVIGuide``: a Gaussian guide over a model's global sites, shaped as prior x client factors.

q(theta) = p(theta) * prod_k t_k(theta) lives in the unconstrained space of the global sites
(constrained sites go through ``biject_to(support)``, as with AutoNormal). The guide is an ordinary
NumPyro guide whose parameters are q's mean and scale (``pvi_loc``, ``pvi_scale_raw``); PVI reads
and writes q through :meth:`PVIGuide.params_from` and :meth:`PVIGuide.q_from`, and keeps the
factors themselves in natural parameters (:mod:`fedppl.families.gaussian`).

Example::

    >>> guide = PVIGuide(model, family="fullrank")
    >>> guide.setup(X, y)                          # trace once: sites, shapes, the prior
    >>> params = guide.params_from(guide.prior)    # q = prior
    >>> samples = guide.sample(key, guide.prior, 100)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from jax import Array

from fedppl.families import gaussian as g
from fedppl.sites import SiteLayout, prior_factor

__all__ = ["PVIGuide"]

FAMILIES = ("meanfield", "fullrank")


class PVIGuide:
    """Gaussian guide over the global latent sites of ``model`` (see module doc).

    :param model: a NumPyro model.
    :param global_sites: names of the global latent sites; default all latent sites.
    :param family: ``"meanfield"`` (diagonal factors) or ``"fullrank"`` (one joint Gaussian).
    """

    def __init__(self, model: Callable, global_sites: Sequence[str] | None = None,
                 family: str = "meanfield"):
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        self.model = model
        self.global_sites = None if global_sites is None else tuple(global_sites)
        self.family = family
        self.layout: SiteLayout | None = None
        self.prior: g.Gaussian | None = None

    @property
    def diag(self) -> bool:
        return self.family == "meanfield"

    def setup(self, *args: Any, **kwargs: Any) -> PVIGuide:
        """Trace the model on prototype data to find the sites and the prior (idempotent)."""
        if self.layout is None:
            self.layout = SiteLayout.from_model(
                self.model, *args, global_sites=self.global_sites, **kwargs
            )
            self.prior = g.strong(prior_factor(self.layout, self.family))
        return self

    def _require_setup(self) -> SiteLayout:
        if self.layout is None:
            raise RuntimeError("call guide.setup(*model_args) first (PVI.run does this)")
        return self.layout

    # -- the NumPyro guide ---------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        layout = self._require_setup()
        init = self.params_from(self.prior)
        loc = numpyro.param("pvi_loc", init["pvi_loc"])
        raw = numpyro.param("pvi_scale_raw", init["pvi_scale_raw"])
        theta = numpyro.sample("_pvi_theta", self._base(loc, raw), infer={"is_auxiliary": True})
        for site, u in zip(layout.sites, layout.unpack(theta).values()):
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
        raw = jnp.tril(sc, -1) + jnp.einsum("...i,ij->...ij", jnp.log(diag), jnp.eye(sc.shape[-1]))
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
        layout = self._require_setup()
        mean, cov = g.to_moments(q)
        out = {}
        for s in layout.sites:
            block = cov[s.slice] if self.diag else cov[s.slice, s.slice]
            out[s.name] = layout.site_distribution(s.name, mean[s.slice], block, self.diag)
        return out

    def sample(self, rng_key: Array, q: g.Gaussian, num_samples: int) -> dict[str, Array]:
        """Joint draws from ``q``, constrained, keyed by site: ``{name: (num_samples, *shape)}``."""
        layout = self._require_setup()
        return layout.constrain(g.sample(rng_key, q, num_samples))


def _tril_from_raw(raw: Array) -> Array:
    """Lower-triangular scale with a positive diagonal from an unconstrained square matrix."""
    diag = jnp.exp(jnp.diagonal(raw, axis1=-2, axis2=-1))
    return jnp.tril(raw, -1) + diag[..., None] * jnp.eye(raw.shape[-1], dtype=raw.dtype)
