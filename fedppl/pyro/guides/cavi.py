"""Closed-form Polya-Gamma CAVI for Bernoulli-logit Pyro models with logits affine in ``theta``.

The twin of :mod:`fedppl.guides.cavi`: with ``f = f0 + J theta`` read from the model (the
:mod:`~fedppl.pyro.handlers.polya_gamma` messenger exposes the logits, ``torch.func.jacfwd``
differentiates them) and a Gaussian prior or cavity ``p0``, the updates are
``c_n = sqrt(m_n^2 + v_n)`` and ``Lambda = Lambda_0 + J' diag(w E[omega]) J``,
``eta = eta_0 + J' w (kappa - E[omega] f0)``; a ``"meanfield"`` guide keeps the exact mean and the
diagonal of ``Lambda``. Every function is batched over leading axes (PVI's clients).

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    >>> X = torch.randn(50, 2)
    >>> y = (X[:, 0] > 0).float()
    >>> result = CAVI(model, PVIGuide(model, family="fullrank"), num_iters=20).run(X, y)
    >>> tuple(result.elbo.shape), bool(result.elbo[-1] >= result.elbo[0])
    ((20,), True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedppl.pyro.algorithms import conjugate
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.families import polya_gamma as pg
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.polya_gamma import PolyaGammaBernoulli, polya_gamma
from fedppl.pyro.sites import SiteLayout, is_identity

__all__ = ["LogitLikelihood", "CAVIResult", "CAVI", "logit_terms", "logit_values", "check",
           "site_factor", "optimal_c", "update_q", "elbo", "fit", "iterate"]


class LogitLikelihood(NamedTuple):
    """All Bernoulli observations flattened: logits ``offset + J theta``, ``kappa = y - 1/2``
    and weights (mask times scale; zero for masked rows)."""

    J: Tensor
    offset: Tensor
    kappa: Tensor
    weight: Tensor


class CAVIResult(NamedTuple):
    q: g.Gaussian
    c: Tensor
    elbo: Tensor


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
    return LogitLikelihood(torch.where(keep.unsqueeze(-1), J, 0.0), torch.where(keep, f0, 0.0),
                           torch.where(keep, kappa, 0.0), torch.where(keep, weight, 0.0))


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


def _logit_moments(lik: LogitLikelihood, q: g.Gaussian) -> tuple[Tensor, Tensor]:
    mean, cov = g.to_moments(q)
    m = lik.offset + torch.einsum("...nd,...d->...n", lik.J, mean)
    if isinstance(q, g.DiagGaussian):
        v = ((lik.J * cov.unsqueeze(-2)) * lik.J).sum(-1)
    else:
        v = ((lik.J @ cov) * lik.J).sum(-1)
    return m, v


def optimal_c(lik: LogitLikelihood, q: g.Gaussian) -> Tensor:
    """The ``q(omega)`` update ``c_n = sqrt(m_n^2 + v_n)``."""
    return pg.optimal_c(*_logit_moments(lik, q))


def site_factor(lik: LogitLikelihood, c: Tensor) -> g.FullGaussian:
    """All Polya-Gamma sites as one Gaussian factor in ``theta``."""
    omega = lik.weight * pg.mean(1.0, c)
    Jt = lik.J.transpose(-1, -2)
    return g.FullGaussian(torch.einsum("...dn,...n->...d", Jt,
                                       lik.weight * lik.kappa - omega * lik.offset),
                          Jt @ (omega.unsqueeze(-1) * lik.J))


def update_q(prior: g.Gaussian, lik: LogitLikelihood, c: Tensor) -> g.Gaussian:
    """The ``q(theta)`` update (mean-field for a diagonal prior)."""
    target = g.product(g.to_full(prior), site_factor(lik, c))
    assert isinstance(target, g.FullGaussian)
    return g.project_diag(target) if isinstance(prior, g.DiagGaussian) else target


def elbo(q: g.Gaussian, prior: g.Gaussian, lik: LogitLikelihood, c: Tensor | None = None
         ) -> Tensor:
    """The augmented ELBO; at the optimal ``c`` the Jaakkola-Jordan bound."""
    m, v = _logit_moments(lik, q)
    per = pg.augmented_bound(lik.kappa + 0.5, m, v, c)
    return torch.where(lik.weight > 0, lik.weight * per, 0.0).sum(-1) - g.kl(q, prior)


def fit(prior: g.Gaussian, lik: LogitLikelihood, num_iters: int = 50,
        q_init: g.Gaussian | None = None) -> CAVIResult:
    """``num_iters`` CAVI sweeps from ``q_init`` (default: the prior); the ELBO after each."""
    q = prior if q_init is None else q_init
    trace = []
    for _ in range(num_iters):
        q = update_q(prior, lik, optimal_c(lik, q))
        trace.append(elbo(q, prior, lik))
    return CAVIResult(q, optimal_c(lik, q), torch.stack(trace, -1))


def iterate(prior: g.Gaussian, lik: LogitLikelihood, q_init: g.Gaussian, max_iters: int,
            tol: float = 1e-10) -> tuple[g.Gaussian, Tensor]:
    """CAVI sweeps for a batch (leading axis) until each one's ``max |c - c_prev| <= tol (1 +
    |c|)`` or ``max_iters``; returns ``(q, sweeps)``, a stopped entry frozen."""
    q = q_init
    c = optimal_c(lik, q)
    K = q.nat1.shape[0]
    change = torch.full((K,), torch.inf, dtype=c.dtype)
    sweeps = torch.zeros(K, dtype=torch.long)
    active = (sweeps < max_iters) & (change > tol)
    while bool(active.any()):
        q_new = update_q(prior, lik, c)
        c_new = optimal_c(lik, q_new)
        rel = ((c_new - c).abs() / (1.0 + c_new.abs())).amax(-1) if c.shape[-1] else \
            torch.zeros(K, dtype=c.dtype)
        q = g.where(active, q_new, q)
        c = torch.where(active.unsqueeze(-1), c_new, c)
        change = torch.where(active, rel, change)
        sweeps = sweeps + active.long()
        active = (sweeps < max_iters) & (change > tol)
    return q, sweeps


class CAVI:
    """Global (pooled-data) CAVI for a Bernoulli-logit Pyro model under a :class:`PVIGuide`'s
    family (default full rank)."""

    def __init__(self, model: Callable, guide: PVIGuide | None = None, num_iters: int = 50):
        self.model = model
        self.guide = guide if guide is not None else PVIGuide(model, family="fullrank")
        self.num_iters = int(num_iters)

    def run(self, *args: Any, prior: g.Gaussian | None = None, **kwargs: Any) -> CAVIResult:
        """Fit ``q`` to the data ``args``; ``prior`` overrides the model's (e.g. a cavity)."""
        layout = self.guide.setup(*args, **kwargs).layout
        assert layout is not None and self.guide.prior is not None
        reason = check(self.model, layout, *args, **kwargs)
        if reason is not None:
            raise ValueError(f"CAVI needs Bernoulli logits affine in the global sites: {reason}")
        lik = logit_terms(self.model, layout, *args, **kwargs)
        return fit(self.guide.prior if prior is None else prior, lik, self.num_iters)
