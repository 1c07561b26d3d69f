"""``PVIGuide`` for a Pyro model: the core's :class:`fedppl.guides.PVIGuide`, whose sites, shapes,
constraints and prior come from tracing the Pyro model with torch.

What the core asks of a guide (``prior``, ``prior_correction``, ``diag``, ``client_diag``,
``structure``, ``init_local``, ``params_from``/``q_from``) is the core's, in JAX; what touches Pyro
is this class's: :meth:`setup` traces the model with ``pyro.poutine`` (the layout of the global
and local sites, the prior's Gaussian base and its correction, :mod:`fedppl.pyro.sites`),
:meth:`log_lik_fn` gives the core's local steps, check and sampler the client's log density,
gradient and Hessian from torch (:mod:`fedppl.pyro.algorithms.terms`), :meth:`check_clients`
checks the clients before them (:mod:`fedppl.pyro.checks`), :meth:`base_draws` gives them
torch's fixed draws, and the posterior is read in torch (:meth:`posterior`, :meth:`sample`). As
a Pyro guide its parameters are q's mean and raw scale (``pvi_loc``, ``pvi_scale_raw``, in Pyro's
param store).

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     s = pyro.sample("s", dist.HalfNormal(1.0))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, s), obs=y)
    >>> guide = PVIGuide(model, family="fullrank", dtype=torch.float32)
    >>> guide = guide.setup(torch.zeros(5, 2), torch.zeros(5))
    >>> guide.layout.names, guide.layout.corrected        # HalfNormal: an exact prior factor
    (('w', 's'), ('s',))
    >>> draws = guide.sample(torch.Generator().manual_seed(0), guide.prior, 100)
    >>> tuple(draws["w"].shape), bool((draws["s"] > 0).all())
    ((100, 2), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import pyro
import pyro.distributions as dist
import torch
from torch import Tensor

from fedppl.guides import pvi_guide as core
from fedppl.pyro.algorithms import terms
from fedppl.pyro.bridge import differentiable, jax_dtype, to_jax, torch_dtype
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


class PVIGuide(core.PVIGuide):
    """Gaussian guide over the global latent sites of a Pyro ``model``; the arguments are those
    of :class:`fedppl.guides.PVIGuide`, with ``dtype`` a torch floating dtype (default torch's
    default dtype at :meth:`setup`; ``torch.float64`` needs ``numpyro.enable_x64()``)."""

    layout: SiteLayout | None  # type: ignore[assignment]  # torch's, with the same fields
    local_layout: SiteLayout | None  # type: ignore[assignment]

    def setup(self, *args: Any, **kwargs: Any) -> PVIGuide:
        """Trace the model on prototype data (one client's arrays) to find the global and local
        sites, the prior's Gaussian base and its correction (again only when the arrays' shapes
        or the keyword arguments change)."""
        dtype = float_dtype(self.dtype)
        jax_dtype(dtype)  # float64 needs JAX's 64-bit mode: refused here, naming it
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
            self.prior = to_jax(prior_factor(self.layout, self.family))
            correction = prior_correction(self.model, self.layout, self.family, args, kwargs)
            self.prior_correction = None if correction is None else differentiable(correction)
        return self

    def layout_or_raise(self) -> SiteLayout:  # type: ignore[override]  # torch's layout
        return cast(SiteLayout, super().layout_or_raise())

    # -- what the core's local steps ask of the PPL ------------------------------------------------

    def log_lik_fn(self, model: Callable, data: tuple, mask: Any) -> Callable:
        """The client's ``(phi, seed) -> log p(y_k, z_k | theta)`` in JAX, evaluated (with its
        gradient and Hessian) by torch on the Pyro model."""
        return terms.log_lik_fn(model, self, data, mask)

    def check_clients(self, clients: Any, model_kwargs: dict, who: str = "the run") -> None:
        """The clients against the Pyro model before a run that needs each client's exact
        log-likelihood (the core's check and sampler): every observation in its support, local
        sites of one shape, no subsampling plate (:mod:`fedppl.pyro.checks`)."""
        from fedppl.pyro.checks import check_clients, refuse_subsampling

        check_clients(self, clients, model_kwargs)
        data = cast_floats(clients.client(0), self.layout_or_raise().dtype)
        refuse_subsampling(self.model, data, model_kwargs, who)

    def base_draws(self, num_draws: int, dim: int, dtype: Any, seed: int = 0) -> Any:
        """The natural-gradient step's fixed draws from torch's generator
        (:func:`fedppl.pyro.algorithms.natural_gradient.base_draws`)."""
        from fedppl.pyro.algorithms import natural_gradient

        with jax.ensure_compile_time_eval():  # constants, even when a round is being traced
            eps = natural_gradient.base_draws(num_draws, dim, torch_dtype(dtype), seed)
            return jnp.asarray(eps.numpy())

    # -- the Pyro guide ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """The guide over the global sites as a Pyro guide (for ``Trace_ELBO`` and the
        ``cavity`` messenger); PVI itself does not call it."""
        layout = self.layout_or_raise()
        init = self.params_from(g.to_torch(self.prior_or_raise()))
        loc = pyro.param("pvi_loc", init["pvi_loc"])
        raw = pyro.param("pvi_scale_raw", init["pvi_scale_raw"])
        base = (dist.Normal(loc, raw.exp()).to_event(1) if self.diag
                else dist.MultivariateNormal(loc, scale_tril=_tril_from_raw(raw)))
        theta = pyro.sample("_pvi_theta", base, infer={"is_auxiliary": True})
        for site, u in zip(layout.sites, layout.unpack(theta).values(), strict=True):
            value = site.transform(u)
            ladj = site.transform.log_abs_det_jacobian(u, value).sum()
            pyro.sample(site.name, dist.Delta(value, log_density=-ladj, event_dim=len(site.shape)))

    def params_from(self, q: Any) -> dict[str, Any]:
        """Guide parameters (mean and raw scale) that represent ``q`` (torch for a torch ``q``)."""
        if not isinstance(q.nat1, Tensor):
            return super().params_from(q)
        return g.to_torch(super().params_from(to_jax(q)))

    # -- reading a posterior (torch) ---------------------------------------------------------------

    def posterior(self, q: g.Gaussian) -> dict[str, dist.Distribution]:
        """Per-site marginal distributions of ``q`` in the constrained space."""
        layout = self.layout_or_raise()
        mean, cov = g.to_moments(q)
        out = {}
        for s in layout.sites:
            block = cov[s.slice] if self.diag else cov[s.slice, s.slice]
            out[s.name] = layout.site_distribution(s.name, mean[s.slice], block, self.diag)
        return out

    def sample(self, rng_key: torch.Generator | None, q: g.Gaussian,  # type: ignore[override]
               num_samples: int, local: g.Conditional | None = None) -> dict[str, Tensor]:
        """Joint draws from ``q``, constrained, keyed by site: ``{name: (num_samples, *shape)}``;
        with ``local`` (one client's private guide, or several stacked) the local sites too, with
        the client axis after the draw axis."""
        layout = self.layout_or_raise()
        theta = g.sample(rng_key, q, num_samples)
        out = layout.constrain(theta)
        if local is not None:
            if self.local_layout is None:
                raise ValueError("local was given but the model has no local sites")
            local = g.to_torch(local)
            if local.nat1.ndim == 1:
                z = _sample_conditional(rng_key, local, theta)
            else:
                z = torch.stack([_sample_conditional(rng_key, g.index(local, k), theta)
                                 for k in range(local.nat1.shape[0])], 1)
            out.update(self.local_layout.constrain(z))
        return out


def _sample_conditional(gen: torch.Generator | None, c: Any, theta: Tensor) -> Tensor:
    """Draws of ``z ~ q(z | theta)`` for each row of ``theta`` (``c`` a Conditional, in torch)."""
    chol = torch.linalg.cholesky(c.prec)
    rhs = c.nat1 - theta @ c.cross.T
    mean = torch.cholesky_solve(rhs.T, chol).T
    eps = torch.randn(mean.shape, generator=gen, dtype=mean.dtype)
    return mean + torch.linalg.solve_triangular(chol.T, eps.T, upper=True).T


def _tril_from_raw(raw: Tensor) -> Tensor:
    """Lower-triangular scale with a positive diagonal from an unconstrained square matrix."""
    return torch.tril(raw, -1) + torch.diag_embed(torch.diagonal(raw, dim1=-2, dim2=-1).exp())
