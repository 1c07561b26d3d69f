"""The hierarchical variational model (HVM) guide of the federated sparse GP.

``q(beta, Z, u) = q(beta) q(Z) q(u | Z, beta)`` with

* ``q(beta) = p(beta) prod_k t_k(beta)``: Gaussian factors over ``log beta`` (LogNormal in beta);
* ``q(Z) = N(Z; 0, I) prod_k t_k(Z)``: fully factorised Gaussian factors (the HVM's auxiliary
  variables, drawn directly at the ``"Z"`` site so that ``tempered`` scales their KL);
* ``q(u | Z, beta) ∝ p(u | Z, beta) prod_k t_k(u | Z, beta)`` with one factor per client:

  - ``"dpo"``: ``t_k ∝ N(K_{V_k Z} K_ZZ^-1 u; m_k, S_k)``, pseudo-inputs ``V_k`` (M_k x D), ``S_k``
    diagonal (``s_raw`` = log variances) or full (``s_raw`` = lower Cholesky factor of ``S_k`` with
    a log diagonal);
  - ``"cpo"``: ``t_k = N(u; m_k, S_k)`` with the factor precision ``S_k^-1 = R R'`` (``s_raw`` = R
    with a log diagonal), so every factor is PSD and the cavity is always a proper Gaussian;
  - ``"opt"``: the optimal factor of a Gaussian likelihood, ``V = X, m = y, S = noise^2 I``
    (Titsias' collapsed q(u); used only where the data sit with the optimiser: global VI).

Every factor is reduced to whitened ``(A_k, c_k) = (L^-1 B_k L^-T, L^-1 b_k)`` (see
:mod:`fedppl.models.sparse_gp`); padded
pseudo-points are switched off by a mask.

Example::

    >>> L = jnp.linalg.cholesky(sparse_gp.kzz(Z, hyper))
    >>> A, c = summed_stats("dpo", "diag", pseudo, mask, jnp.ones(K), Z, hyper, L)
    >>> post = sparse_gp.posterior(L, A, c)
    >>> numpyro.handlers.trace(partial(hvm_guide, local_q, True, True)).get_trace()
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array

from fedppl.families.gaussian import DiagGaussian, to_moments
from fedppl.models.kernels import se
from fedppl.models.sparse_gp import Hyper

__all__ = ["Pseudo", "LocalQ", "summed_stats", "tril_param", "init_dpo", "init_cpo",
           "local_q_from", "to_factors", "hvm_guide"]


class Pseudo(NamedTuple):
    """Pseudo-observation parameters of one client (or stacked on a leading client axis)."""

    V: Array      # (M_k, D) pseudo-inputs (DPO, opt); (0, D) for CPO
    m: Array      # (M_k,) pseudo-observations (CPO: (M,) factor mean)
    s_raw: Array  # diag: (M_k,) log variances; full / CPO: (M_k, M_k) raw lower factor


class LocalQ(NamedTuple):
    """A client's working ``q(log beta)`` and ``q(Z)`` as means and log standard deviations."""

    beta_loc: Array
    beta_logsd: Array
    z_loc: Array
    z_logsd: Array


def tril_param(raw: Array) -> Array:
    """Lower-triangular factor with a positive (exponentiated) diagonal."""
    return jnp.tril(raw, -1) + jnp.diag(jnp.exp(jnp.diagonal(raw)))


def _dpo_diag(pseudo: Pseudo, prec: Array, Z: Array, hyper: Hyper, L: Array
              ) -> tuple[Array, Array]:
    V = pseudo.V.reshape(-1, Z.shape[1])
    W = jsl.solve_triangular(L, se(Z, V, hyper.lengthscale, hyper.variance), lower=True)
    w = prec.reshape(-1)
    return (W * w) @ W.T, W @ (w * pseudo.m.reshape(-1))


def _dpo_full_one(pseudo: Pseudo, mask: Array, Z: Array, hyper: Hyper, L: Array
                  ) -> tuple[Array, Array]:
    Kvz = se(pseudo.V, Z, hyper.lengthscale, hyper.variance) * mask[:, None]
    both = mask[:, None] & mask[None, :]
    Ls = jnp.where(both, tril_param(pseudo.s_raw), jnp.eye(mask.shape[0]))
    G = jsl.solve_triangular(Ls, jsl.solve_triangular(L, Kvz.T, lower=True).T, lower=True)
    r = jsl.solve_triangular(Ls, pseudo.m * mask, lower=True)
    return G.T @ G, G.T @ r                          # G = S^-1/2 K_VZ L^-T


def _cpo_prec(s_raw: Array) -> Array:
    R = tril_param(s_raw)
    return R @ R.T


def summed_stats(kind: str, cov: str, pseudo: Pseudo, mask: Array, weights: Array, Z: Array,
                 hyper: Hyper, L: Array) -> tuple[Array, Array]:
    """Whitened ``(A, c) = (L^-1 B L^-T, L^-1 b)`` of ``sum_k w_k`` factor k (stacked on axis 0),
    with ``L = chol(K_ZZ + jitter)``."""
    if kind == "opt":
        return _dpo_diag(pseudo, weights[:, None] * mask / hyper.noise**2, Z, hyper, L)
    if kind == "dpo" and cov == "diag":
        prec = weights[:, None] * mask * jnp.exp(-pseudo.s_raw)
        return _dpo_diag(pseudo, prec, Z, hyper, L)
    if kind == "dpo":
        As, cs = jax.vmap(_dpo_full_one, (0, 0, None, None, None))(pseudo, mask, Z, hyper, L)
        return jnp.tensordot(weights, As, 1), jnp.tensordot(weights, cs, 1)
    if kind == "cpo":  # B = K P K, b = K n  =>  A = L' P L, c = L' n
        precs = jax.vmap(_cpo_prec)(pseudo.s_raw)
        Pm = jnp.tensordot(weights, precs, 1)
        n = jnp.tensordot(weights, jnp.einsum("kij,kj->ki", precs, pseudo.m), 1)
        return L.T @ Pm @ L, L.T @ n
    raise ValueError(f"unknown factor kind {kind!r}")


def init_dpo(rng: np.random.Generator, X_k: np.ndarray, num_pseudo: int, max_pseudo: int,
             covariance: str, from_data: bool) -> tuple[Pseudo, np.ndarray]:
    """Initial DPO factor of one client, padded to ``max_pseudo``: ``m = 0``, ``S = I`` (a weak
    factor, so q(u) starts near the prior) and ``V`` either a random subset of the client's
    inputs (``from_data``; note V is sent to the server, so this reveals those inputs at the
    first communication) or a draw from N(0, I) (nothing revealed). Returns params and mask."""
    D = X_k.shape[1]
    if from_data:
        idx = rng.choice(X_k.shape[0], size=num_pseudo, replace=False)
        V = X_k[idx]
    else:
        V = rng.standard_normal((num_pseudo, D))
    V = np.concatenate([V, np.zeros((max_pseudo - num_pseudo, D))])
    mask = np.arange(max_pseudo) < num_pseudo
    if covariance == "diag":
        s_raw = np.zeros(max_pseudo)
    else:
        s_raw = np.zeros((max_pseudo, max_pseudo))
    return Pseudo(V, np.zeros(max_pseudo), s_raw), mask


def init_cpo(num_inducing: int, input_dim: int, precision: float = 1e-2) -> Pseudo:
    """Initial CPO factor: mean 0, precision ``precision * I`` (weak)."""
    s_raw = np.diag(np.full(num_inducing, 0.5 * np.log(precision)))
    return Pseudo(np.zeros((0, input_dim)), np.zeros(num_inducing), s_raw)


def local_q_from(q_beta: DiagGaussian, q_z: DiagGaussian) -> LocalQ:
    """Mean / log-sd parameters of the current ``q(beta)``, ``q(Z)`` (the client's start)."""
    mb, vb = to_moments(q_beta)
    mz, vz = to_moments(q_z)
    return LocalQ(mb, 0.5 * jnp.log(vb), mz, 0.5 * jnp.log(vz))


def to_factors(lq: LocalQ, cav_beta: DiagGaussian, cav_z: DiagGaussian
               ) -> tuple[DiagGaussian, DiagGaussian]:
    """The client's new factors ``t_k = q_new / q_cavity`` in natural parameters."""
    qb = DiagGaussian.from_moments(lq.beta_loc, jnp.exp(2 * lq.beta_logsd))
    qz = DiagGaussian.from_moments(lq.z_loc, jnp.exp(2 * lq.z_logsd))
    return (DiagGaussian(qb.nat1 - cav_beta.nat1, qb.prec - cav_beta.prec),
            DiagGaussian(qz.nat1 - cav_z.nat1, qz.prec - cav_z.prec))


def hvm_guide(lq: LocalQ, sample_beta: bool, sample_z: bool) -> None:
    """The guide: ``log_beta ~ N(beta_loc, e^beta_logsd)``, ``Z ~ N(z_loc, e^z_logsd)``, sampled
    directly (reparametrised) so that ``tempered(..., sites=["Z"])`` scales the Z entropy."""
    if sample_beta:
        numpyro.sample("log_beta", dist.Normal(lq.beta_loc, jnp.exp(lq.beta_logsd)).to_event(1))
    if sample_z:
        numpyro.sample("Z", dist.Normal(lq.z_loc, jnp.exp(lq.z_logsd)).to_event(2))
