"""Closed-form Polya-Gamma CAVI for Bernoulli-logit Pyro models with logits affine in ``theta``.

The core's :mod:`fedppl.guides.cavi` on a Pyro model: the logits ``f = f0 + J theta`` are read
from the model by torch (the :mod:`~fedppl.pyro.handlers.polya_gamma` messenger exposes them,
``torch.func.jacfwd`` differentiates them) as the core's
:class:`~fedppl.guides.cavi.LogitLikelihood`; the sweeps, the ELBO and PVI's Polya-Gamma local
step are the core's.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    >>> X = torch.randn(50, 2)
    >>> y = (X[:, 0] > 0).float()
    >>> guide = PVIGuide(model, family="fullrank", dtype=torch.float32)
    >>> result = CAVI(model, guide, num_iters=20).run(X, y)
    >>> tuple(result.elbo.shape), bool(result.elbo[-1] >= result.elbo[0])
    ((20,), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedppl.guides import cavi as core
from fedppl.guides.cavi import CAVIResult, LogitLikelihood
from fedppl.pyro.algorithms import conjugate
from fedppl.pyro.bridge import to_jax, to_torch
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.polya_gamma import PolyaGammaBernoulli, polya_gamma
from fedppl.pyro.sites import SiteLayout, cast_floats, is_identity

__all__ = ["CAVI", "logit_terms", "logit_values", "check"]


def logit_values(model: Callable, layout: SiteLayout, theta: Tensor, args: tuple, kwargs: dict
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Flat logits, ``kappa`` and weights of all observed sites (all must be Bernoulli)."""
    fs, ks, ws = [], [], []
    for name, fn, value, weight in conjugate.observed_sites(polya_gamma(model), layout, theta,
                                                            args, kwargs):
        if not isinstance(fn, PolyaGammaBernoulli):
            raise conjugate.NotConjugate(
                f"observed site '{name}' is {type(fn).__name__}, not a Bernoulli")
        fs.append(fn.logits.reshape(-1))
        ks.append(value.to(fn.logits.dtype).reshape(-1) - 0.5)
        ws.append(weight.reshape(-1).to(fn.logits.dtype))
    if not fs:
        raise conjugate.NotConjugate("the model has no observed sites")
    return torch.cat(fs), torch.cat(ks), torch.cat(ws)


def logit_terms(model: Callable, layout: SiteLayout, *args: Any, **kwargs: Any
                ) -> LogitLikelihood:
    """``J``, offset, ``kappa`` and weights of a model whose logits are affine in ``theta``."""
    theta0 = torch.zeros(layout.dim, dtype=layout.dtype)
    f0, kappa, weight = logit_values(model, layout, theta0, args, kwargs)
    J = torch.func.jacfwd(lambda t: logit_values(model, layout, t, args, kwargs)[0])(theta0)
    keep = weight > 0
    terms: Any = (torch.where(keep.unsqueeze(-1), J, 0.0), torch.where(keep, f0, 0.0),
                  torch.where(keep, kappa, 0.0), torch.where(keep, weight, 0.0))  # in torch
    return LogitLikelihood(*terms)


def check(model: Callable, layout: SiteLayout, *args: Any, seed: int = 0, **kwargs: Any
          ) -> str | None:
    """``None`` if every observed site is a Bernoulli with logits affine in unconstrained global
    sites, else the reason. Runs eagerly: bad labels raise."""
    for s in layout.sites:
        if not is_identity(s.transform):
            return f"global site '{s.name}' is constrained ({type(s.transform).__name__})"
    try:
        logit_values(model, layout, torch.zeros(layout.dim, dtype=layout.dtype), args, kwargs)
        return conjugate.affine_reason(
            lambda t: logit_values(model, layout, t, args, kwargs)[0], layout.dim, layout.dtype,
            seed, what="the logit of an observed Bernoulli site")
    except conjugate.NotConjugate as e:
        return str(e)


class CAVI:
    """Global (pooled-data) CAVI for a Bernoulli-logit Pyro model under a :class:`PVIGuide`'s
    family (default full rank)."""

    def __init__(self, model: Callable, guide: PVIGuide | None = None, num_iters: int = 50):
        self.model = model
        self.guide = guide if guide is not None else PVIGuide(model, family="fullrank")
        self.num_iters = int(num_iters)

    def run(self, *args: Any, prior: Any = None, **kwargs: Any) -> CAVIResult:
        """Fit ``q`` to the data ``args``; ``prior`` overrides the model's (e.g. a cavity).
        The result holds torch tensors (``q``, ``c``, ``elbo``)."""
        layout = self.guide.setup(*args, **kwargs).layout
        assert layout is not None and self.guide.prior is not None
        args = cast_floats(args, layout.dtype)
        reason = check(self.model, layout, *args, **kwargs)
        if reason is not None:
            raise ValueError(f"CAVI needs Bernoulli logits affine in the global sites: {reason}")
        lik = LogitLikelihood(*to_jax(logit_terms(self.model, layout, *args, **kwargs)))
        return to_torch(core.fit(self.guide.prior if prior is None else to_jax(prior), lik,
                                 self.num_iters))
