"""``PVIGuide``: a Gaussian guide over a Pyro model's global sites, shaped as prior x client
factors.

The torch twin of :class:`fedppl.guides.PVIGuide`: ``q(theta) = p(theta) prod_k t_k(theta)`` in
the unconstrained space of the global sites (constrained sites through ``biject_to(support)``),
``p`` the prior's Gaussian base times the server's prior factor when the prior is not Gaussian
there; local sites (a client's random effects) get a private conditional guide ``q(z_k | theta)``
at each client (:class:`~fedppl.pyro.families.gaussian.Conditional`). As a Pyro guide its
parameters are q's mean and raw scale (``pvi_loc``, ``pvi_scale_raw``, in Pyro's param store);
PVI reads and writes q through :meth:`PVIGuide.params_from` and :meth:`PVIGuide.q_from`.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     s = pyro.sample("s", dist.HalfNormal(1.0))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, s), obs=y)
    >>> guide = PVIGuide(model, family="fullrank").setup(torch.zeros(5, 2), torch.zeros(5))
    >>> guide.layout.names, guide.layout.corrected        # HalfNormal: an exact prior factor
    (('w', 's'), ('s',))
    >>> draws = guide.sample(torch.Generator().manual_seed(0), guide.prior, 100)
    >>> tuple(draws["w"].shape), bool((draws["s"] > 0).all())
    ((100, 2), True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from fedppl.pyro.families import gaussian as g
from fedppl.pyro.sites import (
    SiteLayout,
    cast_floats,
    classify,
    float_dtype,
    prior_correction,
    prior_factor,
)

__all__ = ["PVIGuide"]

FAMILIES = ("meanfield", "fullrank")
LOCAL = ("joint", "independent")


class PVIGuide:
    """Gaussian guide over the global latent sites of a Pyro ``model`` (see module doc); the
    arguments are those of :class:`fedppl.guides.PVIGuide`.

    :param model: a Pyro model.
    :param global_sites: names of the global latent sites (the others are local to each client).
    :param family: ``"meanfield"`` (diagonal factors) or ``"fullrank"``.
    :param local_sites: names of the local latent sites (an alternative to ``global_sites``).
    :param local: ``"joint"`` (a full Gaussian over ``(theta, z_k)`` at each client) or
        ``"independent"`` (``q(theta) q(z_k)``, ``q(z_k)`` diagonal).
    :param dtype: the torch floating dtype q, the factors and the local steps compute in (the
        model's floating data are cast to it); default torch's default dtype at :meth:`setup`.
    """

    def __init__(self, model: Callable, global_sites: Sequence[str] | None = None,
                 family: str = "meanfield", *, local_sites: Sequence[str] | None = None,
                 local: str = "joint", dtype: torch.dtype | None = None):
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        if local not in LOCAL:
            raise ValueError(f"local must be one of {LOCAL}, got {local!r}")
        self.model = model
        self.global_sites = None if global_sites is None else tuple(global_sites)
        self.local_sites = None if local_sites is None else tuple(local_sites)
        self.family = family
        self.local = local
        self.dtype = dtype
        self.layout: SiteLayout | None = None
        self.local_layout: SiteLayout | None = None
        self.prior: g.Gaussian | None = None
        self.prior_correction: Callable[[Tensor], Tensor] | None = None
        self._signature: tuple[Any, ...] | None = None

    @property
    def diag(self) -> bool:
        return self.family == "meanfield"

    @property
    def client_diag(self) -> bool:
        """Whether a client's joint over ``(theta, z_k)`` is a diagonal Gaussian."""
        return self.diag and (self.local_layout is None or self.local == "independent")

    def setup(self, *args: Any, **kwargs: Any) -> PVIGuide:
        """Trace the model on prototype data (one client's arrays) to find the global and local
        sites, the prior's Gaussian base and its correction (again only when the arrays' shapes
        or the keyword arguments change)."""
        dtype = float_dtype(self.dtype)
        args = cast_floats(args, dtype)
        signature = (tuple(tuple(a.shape) for a in args), repr(sorted(kwargs.items())), dtype)
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
            self.prior = prior_factor(self.layout, self.family)
            self.prior_correction = prior_correction(self.model, self.layout, self.family, args,
                                                     kwargs)
        return self

    def structure(self) -> Tensor | None:
        """For ``family="fullrank", local="independent"``: the precision entries a client's
        joint may have (the global and local blocks, no coupling); else None."""
        if self.local_layout is None or self.local != "independent" or self.diag:
            return None
        D, d = self._require_setup().dim, self.local_layout.dim
        mask = torch.zeros((D + d, D + d), dtype=torch.bool)
        mask[:D, :D] = True
        mask[D:, D:] = torch.eye(d, dtype=torch.bool)
        return mask

    def init_local(self) -> g.Conditional | None:
        """A client's first private guide: ``z_k ~ N(0, I)``, independent of ``theta``."""
        if self.local_layout is None:
            return None
        D, d = self._require_setup().dim, self.local_layout.dim
        dtype = self._require_prior().nat1.dtype
        return g.Conditional(torch.zeros(d, dtype=dtype), torch.eye(d, dtype=dtype),
                             torch.zeros((d, D), dtype=dtype))

    def _require_setup(self) -> SiteLayout:
        if self.layout is None:
            raise RuntimeError("call guide.setup(*model_args) first (PVI.run does this)")
        return self.layout

    def _require_prior(self) -> g.Gaussian:
        self._require_setup()
        assert self.prior is not None
        return self.prior

    # -- the Pyro guide ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """The guide over the global sites as a Pyro guide (for ``Trace_ELBO`` and the
        ``cavity`` messenger); PVI itself does not call it."""
        layout = self._require_setup()
        init = self.params_from(self._require_prior())
        loc = pyro.param("pvi_loc", init["pvi_loc"])
        raw = pyro.param("pvi_scale_raw", init["pvi_scale_raw"])
        theta = pyro.sample("_pvi_theta", self._base(loc, raw),  # type: ignore[arg-type]
                            infer={"is_auxiliary": True})
        for site, u in zip(layout.sites, layout.unpack(theta).values(), strict=True):
            value = site.transform(u)
            ladj = site.transform.log_abs_det_jacobian(u, value).sum()
            pyro.sample(site.name, dist.Delta(value, log_density=-ladj, event_dim=len(site.shape)))

    def _base(self, loc: Tensor, raw: Tensor) -> dist.Distribution:
        if self.diag:
            return dist.Normal(loc, raw.exp()).to_event(1)
        return dist.MultivariateNormal(loc, scale_tril=_tril_from_raw(raw))

    # -- between q (natural parameters) and the guide's parameters --------------------------------

    def params_from(self, q: g.Gaussian) -> dict[str, Tensor]:
        """Guide parameters (mean and raw scale) that represent ``q`` (batched)."""
        mean, sc = g.mean_and_scale_tril(q)
        if self.diag:
            return {"pvi_loc": mean, "pvi_scale_raw": sc.log()}
        diag = torch.diagonal(sc, dim1=-2, dim2=-1)
        raw = torch.tril(sc, -1) + torch.diag_embed(diag.log())
        return {"pvi_loc": mean, "pvi_scale_raw": raw}

    def mean_and_tril(self, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """q's mean and scale (a std vector for mean-field, else the lower Cholesky factor)."""
        loc, raw = params["pvi_loc"], params["pvi_scale_raw"]
        return loc, (raw.exp() if self.diag else _tril_from_raw(raw))

    def q_from(self, params: dict[str, Tensor]) -> g.Gaussian:
        """The Gaussian (natural parameters) the guide parameters describe (batched)."""
        loc, raw = params["pvi_loc"], params["pvi_scale_raw"]
        if self.diag:
            return g.DiagGaussian.from_moments(loc, (2 * raw).exp())
        tril = _tril_from_raw(raw)
        eye = torch.eye(loc.shape[-1], dtype=loc.dtype).expand(tril.shape)
        linv = torch.linalg.solve_triangular(tril, eye, upper=False)
        prec = linv.transpose(-1, -2) @ linv
        prec = 0.5 * (prec + prec.transpose(-1, -2))
        return g.FullGaussian(torch.einsum("...ij,...j->...i", prec, loc), prec)

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

    def sample(self, rng_key: torch.Generator | None, q: g.Gaussian, num_samples: int,
               local: g.Conditional | None = None) -> dict[str, Tensor]:
        """Joint draws from ``q``, constrained, keyed by site: ``{name: (num_samples, *shape)}``;
        with ``local`` (one client's private guide, or several stacked) the local sites too, with
        the client axis after the draw axis."""
        layout = self._require_setup()
        theta = g.sample(rng_key, q, num_samples)
        out = layout.constrain(theta)
        if local is not None:
            if self.local_layout is None:
                raise ValueError("local was given but the model has no local sites")
            if local.nat1.ndim == 1:
                z = _sample_conditional(rng_key, local, theta)
            else:
                z = torch.stack([_sample_conditional(rng_key, g.index(local, k), theta)
                                 for k in range(local.nat1.shape[0])], 1)
            out.update(self.local_layout.constrain(z))
        return out


def _sample_conditional(gen: torch.Generator | None, c: g.Conditional, theta: Tensor) -> Tensor:
    """Draws of ``z ~ q(z | theta)`` for each row of ``theta``."""
    chol = torch.linalg.cholesky(c.prec)
    rhs = c.nat1 - theta @ c.cross.T
    mean = torch.cholesky_solve(rhs.T, chol).T
    eps = torch.randn(mean.shape, generator=gen, dtype=mean.dtype)
    return mean + torch.linalg.solve_triangular(chol.T, eps.T, upper=True).T


def _tril_from_raw(raw: Tensor) -> Tensor:
    """Lower-triangular scale with a positive diagonal from an unconstrained square matrix."""
    return torch.tril(raw, -1) + torch.diag_embed(torch.diagonal(raw, dim1=-2, dim2=-1).exp())
