"""Closed-form CAVI for Bernoulli-logit models whose logits are affine in global Gaussian sites.

For a model with ``logits f = f0 + J theta`` (Bayesian logistic regression, GP classification on
fixed inputs or inducing points, the one-vs-each multi-class model) and a Gaussian prior (or PVI
cavity) ``p0(theta)``, Polya-Gamma augmentation with ``q(theta, omega) = q(theta) prod_n
PG(omega_n | 1, c_n)`` gives two closed-form coordinate updates (pFed-Mul, Eq. 3, App. A-B):

* ``c_n = sqrt(E_q[f_n^2]) = sqrt(m_n^2 + v_n)`` with ``m = f0 + J mu``, ``v = diag(J Sigma J^T)``;
* ``q(theta)`` Gaussian with ``Lambda = Lambda_0 + J^T diag(w E[omega]) J`` and
  ``eta = eta_0 + J^T w (kappa - E[omega] f0)`` (``w``: mask and site scale, ``kappa = y - 1/2``).

The ELBO ``sum_n w_n (E_q[-log 2 + kappa f - E[omega] f^2 / 2] - KL[PG(1, c_n) || PG(1, 0)])
- KL[q(theta) || p0]`` never decreases; at the optimal ``c`` it is the Jaakkola-Jordan bound.
``J`` and ``f0`` come from the model itself: the :class:`~fedppl.handlers.polya_gamma` handler
exposes the logits and ``jax.jacfwd`` differentiates them at ``theta = 0`` (with
:mod:`fedppl.conjugacy`, which :mod:`fedppl.algorithms.conjugate` shares). A ``"meanfield"``
guide gets the mean-field optimum of each ``q(theta)`` step (exact mean, diagonal of ``Lambda``).

Example::

    >>> import numpy as np
    >>> from fedppl.models import logistic_regression
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(50, 2))
    >>> y = (X[:, 0] + 0.5 * rng.normal(size=50) > 0).astype(float)
    >>> guide = PVIGuide(logistic_regression, family="fullrank")
    >>> result = CAVI(logistic_regression, guide, num_iters=20).run(X, y)
    >>> trace = np.asarray(result.elbo)          # one value per sweep, non-decreasing
    >>> trace.shape, bool(trace[-1] > trace[0])
    ((20,), True)
    >>> mean, cov = g.to_moments(result.q)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from fedppl.conjugacy import NotConjugate, affine_reason, constrained_reason, observed_sites
from fedppl.families import gaussian as g
from fedppl.families import polya_gamma as pg
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.polya_gamma import PolyaGammaBernoulli, polya_gamma
from fedppl.sites import SiteLayout

__all__ = ["LogitLikelihood", "CAVIResult", "CAVI", "logit_terms", "check", "site_factor",
           "optimal_c", "update_q", "elbo", "fit", "iterate", "logit_values"]


class LogitLikelihood(NamedTuple):
    """All Bernoulli observations flattened: logits ``offset + J theta``, ``kappa = y - 1/2`` and
    weights (mask times site scale; zero for masked rows)."""

    J: Array  # (n_obs, D)
    offset: Array  # (n_obs,)
    kappa: Array  # (n_obs,)
    weight: Array  # (n_obs,)


class CAVIResult(NamedTuple):
    q: g.Gaussian  # q(theta)
    c: Array  # (n_obs,) q(omega_n) = PG(1, c_n), optimal for q
    elbo: Array  # (num_iters,) ELBO after each sweep (at the optimal c: the JJ bound)


# -- the linear map from the model ----------------------------------------------------------------


def logit_values(model: Callable, layout: SiteLayout, theta: Array, args: tuple, kwargs: dict
                 ) -> tuple[Array, Array, Array]:
    """Flat logits, ``kappa`` and weights of all observed sites (all must be Bernoulli)."""
    fs, ks, ws = [], [], []
    for name, fn, value, weight in observed_sites(polya_gamma(model), layout, theta, args,
                                                  kwargs):
        if not isinstance(fn, PolyaGammaBernoulli):
            raise NotConjugate(f"observed site '{name}' is {type(fn).__name__}, not a Bernoulli")
        fs.append(jnp.reshape(fn.logits, (-1,)))
        ks.append(jnp.reshape(jnp.asarray(value, fn.logits.dtype) - 0.5, (-1,)))
        ws.append(jnp.reshape(weight, (-1,)).astype(fn.logits.dtype))
    if not fs:
        raise NotConjugate("the model has no observed sites")
    return jnp.concatenate(fs), jnp.concatenate(ks), jnp.concatenate(ws)


def logit_terms(model: Callable, layout: SiteLayout, *args: Any, **kwargs: Any
                ) -> LogitLikelihood:
    """``J``, offset, ``kappa`` and weights of a model whose logits are affine in ``theta``."""
    theta0 = jnp.zeros(layout.dim)
    f0, kappa, weight = logit_values(model, layout, theta0, args, kwargs)
    J = jax.jacfwd(lambda t: logit_values(model, layout, t, args, kwargs)[0])(theta0)
    keep = weight > 0
    return LogitLikelihood(jnp.where(keep[:, None], J, 0.0), jnp.where(keep, f0, 0.0),
                           jnp.where(keep, kappa, 0.0), jnp.where(keep, weight, 0.0))


def check(model: Callable, layout: SiteLayout, *args: Any, seed: int = 0, **kwargs: Any
          ) -> str | None:
    """``None`` if every observed site is a Bernoulli with logits affine in unconstrained global
    sites (checked at random points), else the reason. Runs eagerly: bad labels raise."""
    reason = constrained_reason(layout)
    if reason is not None:
        return reason
    try:
        f0, _, _ = logit_values(model, layout, jnp.zeros(layout.dim), args, kwargs)
        return affine_reason(
            lambda t: logit_values(model, layout, t, args, kwargs)[0], layout.dim, f0.dtype, seed,
            what="the logit of an observed Bernoulli site")
    except NotConjugate as e:
        return str(e)


# -- the two coordinate updates and the bound ----------------------------------------------------


def _logit_moments(lik: LogitLikelihood, q: g.Gaussian) -> tuple[Array, Array]:
    mean, cov = g.to_moments(q)
    m = lik.offset + lik.J @ mean
    if isinstance(q, g.DiagGaussian):
        v = jnp.einsum("nd,d,nd->n", lik.J, cov, lik.J)
    else:
        v = jnp.einsum("nd,de,ne->n", lik.J, cov, lik.J)
    return m, v


def optimal_c(lik: LogitLikelihood, q: g.Gaussian) -> Array:
    """The ``q(omega)`` update: ``c_n = sqrt(m_n^2 + v_n)`` for the logits under ``q``."""
    return pg.optimal_c(*_logit_moments(lik, q))


def site_factor(lik: LogitLikelihood, c: Array) -> g.FullGaussian:
    """All Polya-Gamma sites as one Gaussian factor in ``theta`` (natural parameters)."""
    omega = lik.weight * pg.mean(1.0, c)
    return g.FullGaussian(lik.J.T @ (lik.weight * lik.kappa - omega * lik.offset),
                          lik.J.T @ (omega[:, None] * lik.J))


def update_q(prior: g.Gaussian, lik: LogitLikelihood, c: Array) -> g.Gaussian:
    """The ``q(theta)`` update; mean-field (exact mean, diagonal precision) for a diagonal prior."""
    target = g.to_full(g.product(g.to_full(prior), site_factor(lik, c)))
    return g.project_diag(target) if isinstance(prior, g.DiagGaussian) else target


def elbo(q: g.Gaussian, prior: g.Gaussian, lik: LogitLikelihood, c: Array | None = None
         ) -> Array:
    """The augmented ELBO; ``c`` defaults to its optimum (then it is the Jaakkola-Jordan bound)."""
    m, v = _logit_moments(lik, q)
    per = pg.augmented_bound(lik.kappa + 0.5, m, v, c)
    return jnp.sum(jnp.where(lik.weight > 0, lik.weight * per, 0.0)) - g.kl(q, prior)


def fit(prior: g.Gaussian, lik: LogitLikelihood, num_iters: int = 50,
        q_init: g.Gaussian | None = None) -> CAVIResult:
    """``num_iters`` CAVI sweeps (``c`` then ``q``) from ``q_init`` (default: the prior);
    jittable. The ELBO trace is taken after each sweep at the optimal ``c``."""
    q0 = prior if q_init is None else q_init

    def sweep(q, _):
        q = update_q(prior, lik, optimal_c(lik, q))
        return q, elbo(q, prior, lik)

    q, trace = jax.lax.scan(sweep, q0, None, length=num_iters)
    return CAVIResult(q, optimal_c(lik, q), trace)


def iterate(prior: g.Gaussian, lik: LogitLikelihood, q_init: g.Gaussian, max_iters: int,
            tol: float = 1e-10) -> tuple[g.Gaussian, Array]:
    """CAVI sweeps until ``max |c - c_prev| <= tol (1 + |c|)`` or ``max_iters``; ``(q, sweeps)``."""
    c0 = optimal_c(lik, q_init)

    def cond(state):
        _, _, change, i = state
        return (i < max_iters) & (change > tol)

    def body(state):
        _, c, _, i = state
        q = update_q(prior, lik, c)
        c_new = optimal_c(lik, q)
        change = jnp.max(jnp.abs(c_new - c) / (1.0 + jnp.abs(c_new)), initial=0.0)
        return q, c_new, change, i + 1

    q, _, _, n = jax.lax.while_loop(cond, body, (q_init, c0, jnp.asarray(jnp.inf, c0.dtype),
                                                 jnp.asarray(0)))
    return q, n


# -- front end ------------------------------------------------------------------------------------


class CAVI:
    """Global (pooled-data) CAVI for a Bernoulli-logit model under a
    :class:`~fedppl.PVIGuide`'s family.

    :param model: a NumPyro model whose observed sites are Bernoulli with logits affine in the
        (unconstrained, Gaussian-prior) global sites.
    :param guide: a :class:`~fedppl.PVIGuide` (its family and prior are used); default full rank.
    :type guide: fedppl.PVIGuide or None
    :param num_iters: CAVI sweeps.
    """

    def __init__(self, model: Callable, guide: PVIGuide | None = None, num_iters: int = 50):
        self.model = model
        self.guide = guide if guide is not None else PVIGuide(model, family="fullrank")
        self.num_iters = int(num_iters)

    def run(self, *args: Any, prior: g.Gaussian | None = None, **kwargs: Any) -> CAVIResult:
        """Fit ``q`` to the data ``args``; ``prior`` overrides the model's (e.g. a PVI cavity)."""
        layout = self.guide.setup(*args, **kwargs).layout
        assert layout is not None  # setup builds it
        reason = check(self.model, layout, *args, **kwargs)
        if reason is not None:
            raise ValueError(f"CAVI needs Bernoulli logits affine in the global sites: {reason}")
        n = self.num_iters

        @jax.jit
        def run(p0, args):
            return fit(p0, logit_terms(self.model, layout, *args, **kwargs), n)

        return run(self.guide.prior if prior is None else prior, args)
