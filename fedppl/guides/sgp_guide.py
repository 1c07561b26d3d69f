"""The hierarchical variational model (HVM) guide of the federated sparse GP.

``q(beta, Z, u) = q(beta) q(Z) q(u | Z, beta)`` with

* ``q(beta) = p(beta) prod_k t_k(beta)``: Gaussian factors over ``log beta`` (LogNormal in beta);
* ``q(Z) = N(Z; 0, I) prod_k t_k(Z)``: fully factorised Gaussian factors (the HVM's auxiliary
  variables, drawn directly at the ``"Z"`` site so that ``tempered`` scales their KL);
* ``q(u | Z, beta) ∝ p(u | Z, beta) prod_k t_k(u | Z, beta)`` with one factor per client:

  - ``"dpo"``: ``t_k ∝ N(K_{V_k Z} K_ZZ^-1 u; m_k, S_k)``, pseudo-inputs ``V_k`` (M_k x D), ``S_k``
    diagonal (``s_raw`` = log variances), diagonal relative to the noise (``"noise"``:
    ``S_k = noise^2 diag(exp(s_raw))``, so that ``s_raw = 0`` with ``V_k``, ``m_k`` at the
    client's data is the optimal factor of a Gaussian likelihood, at every beta) or full
    (``s_raw`` = the unconstrained vector of the lower Cholesky factor of ``S_k``, see
    :func:`lower_cholesky`);
  - ``"cpo"``: ``t_k = N(u; m_k, S_k)`` with the factor precision ``S_k^-1 = R R'`` (``s_raw`` =
    R's unconstrained vector), so every factor is PSD and the cavity is always a proper Gaussian;
  - ``"opt"``: the optimal factor of a Gaussian likelihood, ``V = X, m = y, S = noise^2 I``
    (Titsias' collapsed q(u); used only where the data sit with the optimiser: global VI).

Every factor is reduced to whitened ``(A_k, c_k) = (L^-1 B_k L^-T, L^-1 b_k)`` (see
:mod:`fedppl.models.sparse_gp`); padded pseudo-points are switched off by a mask.

Example::

    >>> import jax.numpy as jnp, numpy as np
    >>> from fedppl.models import sparse_gp
    >>> from fedppl.models.kernels import SEParams
    >>> Z, hyper = jnp.linspace(-1.0, 1.0, 4)[:, None], SEParams.init(1)
    >>> pseudo, mask = init_dpo(np.random.default_rng(0), np.ones((5, 1)), 3, 4, "diag", False)
    >>> stack = Pseudo(*(jnp.asarray(a)[None] for a in pseudo))      # one client
    >>> L = jnp.linalg.cholesky(sparse_gp.kzz(Z, hyper))
    >>> A, c = summed_stats("dpo", "diag", stack, jnp.asarray(mask)[None], jnp.ones(1), Z,
    ...                     hyper, L)
    >>> A.shape, float(jnp.abs(c).max())                                 # m_k = 0 at the start
    ((4, 4), 0.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from fedppl.families import gaussian as g
from fedppl.models.kernels import SEParams

__all__ = ["Pseudo", "LocalQ", "summed_stats", "lower_cholesky", "tril_size", "init_dpo",
           "init_cpo", "local_q_from", "to_factors", "hvm_guide"]

_CHOLESKY = biject_to(constraints.lower_cholesky)


class Pseudo(NamedTuple):
    """Pseudo-observation parameters of one client (or stacked on a leading client axis)."""

    V: Array | np.ndarray      # (M_k, D) pseudo-inputs (DPO, opt); (0, D) for CPO
    m: Array | np.ndarray      # (M_k,) pseudo-observations (CPO: (M,) factor mean)
    s_raw: Array | np.ndarray  # diag: (M_k,) log variances; full / CPO: (M_k (M_k + 1) / 2,)


class LocalQ(NamedTuple):
    """A client's working ``q(log beta)`` and ``q(Z)`` as means and log standard deviations."""

    beta_loc: Array
    beta_logsd: Array
    z_loc: Array
    z_logsd: Array


def lower_cholesky(raw: Array | np.ndarray) -> Array:
    """The lower-triangular factor of an unconstrained vector (numpyro's ``lower_cholesky``
    bijection: the strictly lower entries as they are, then the log diagonal)."""
    return _CHOLESKY(raw)


def tril_size(n: int) -> int:
    """Length of the unconstrained vector of an ``n x n`` lower-triangular factor."""
    return n * (n + 1) // 2


def _dpo_diag_one(pseudo: Pseudo, prec: Array, Z: Array, hyper: SEParams, L: Array
                  ) -> tuple[Array, Array]:
    """One client's diagonal DPO factor, whitened: ``(W diag(prec) W', W diag(prec) m)`` with
    ``W = L^-1 K_ZV``."""
    W = jsl.solve_triangular(L, hyper.kernel(Z, pseudo.V), lower=True)
    return (W * prec) @ W.T, W @ (prec * pseudo.m)


def _dpo_full_one(pseudo: Pseudo, mask: Array, Z: Array, hyper: SEParams, L: Array
                  ) -> tuple[Array, Array]:
    Kvz = hyper.kernel(pseudo.V, Z) * mask[:, None]
    both = mask[:, None] & mask[None, :]
    Ls = jnp.where(both, lower_cholesky(pseudo.s_raw), jnp.eye(mask.shape[0]))
    G = jsl.solve_triangular(Ls, jsl.solve_triangular(L, Kvz.T, lower=True).T, lower=True)
    r = jsl.solve_triangular(Ls, pseudo.m * mask, lower=True)
    return G.T @ G, G.T @ r                          # G = S^-1/2 K_VZ L^-T


def _streamed(one: Callable[..., tuple[Array, Array]], stacked: Any, weights: Array, Z: Array,
              hyper: SEParams, L: Array) -> tuple[Array, Array]:
    """``sum_k weights[k] * one(stacked[k], Z, hyper, L)`` streamed over the client axis
    (``lax.scan``): the memory is one client's share, not K of them, also under ``vmap`` over
    the K clients that each need the others' sum (K^2 otherwise), and in the gradient (the body
    is recomputed). The weights stay apart from the stacked factors, so that a client's own
    weights (every factor but its own) do not copy all K factors."""
    M = L.shape[0]
    body = jax.checkpoint(lambda x: one(*x, Z, hyper, L))

    def add(total: tuple[Array, Array], xw: tuple[Any, Array]
            ) -> tuple[tuple[Array, Array], None]:
        A, c = body(xw[0])
        return (total[0] + xw[1] * A, total[1] + xw[1] * c), None

    zero = (jnp.zeros((M, M), L.dtype), jnp.zeros(M, L.dtype))
    return jax.lax.scan(add, zero, (stacked, weights))[0]


def _cpo_prec(s_raw: Array | np.ndarray) -> Array:
    R = lower_cholesky(s_raw)
    return R @ R.T


def summed_stats(kind: str, cov: str, pseudo: Pseudo, mask: Array, weights: Array, Z: Array,
                 hyper: SEParams, L: Array) -> tuple[Array, Array]:
    """Whitened ``(A, c) = (L^-1 B L^-T, L^-1 b)`` of ``sum_k w_k`` factor k (stacked on axis 0),
    with ``L = chol(K_ZZ + jitter)``."""
    if kind == "opt":
        A, c = _streamed(_dpo_diag_one, (pseudo, mask.astype(L.dtype)), weights, Z, hyper, L)
        return A / hyper.noise**2, c / hyper.noise**2
    if kind == "dpo" and cov in ("diag", "noise"):
        prec = mask * jnp.exp(-pseudo.s_raw)
        A, c = _streamed(_dpo_diag_one, (pseudo, prec), weights, Z, hyper, L)
        return (A / hyper.noise**2, c / hyper.noise**2) if cov == "noise" else (A, c)
    if kind == "dpo":
        return _streamed(_dpo_full_one, (pseudo, mask), weights, Z, hyper, L)
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
    size = tril_size(max_pseudo) if covariance == "full" else max_pseudo
    return Pseudo(V, np.zeros(max_pseudo), np.zeros(size)), mask


def init_cpo(num_inducing: int, input_dim: int, precision: float = 1e-2) -> Pseudo:
    """Initial CPO factor: mean 0, precision ``precision * I`` (weak)."""
    n = num_inducing
    s_raw = np.concatenate([np.zeros(tril_size(n) - n), np.full(n, 0.5 * np.log(precision))])
    return Pseudo(np.zeros((0, input_dim)), np.zeros(n), s_raw)


def local_q_from(q_beta: g.DiagGaussian, q_z: g.DiagGaussian) -> LocalQ:
    """Mean / log-sd parameters of the current ``q(beta)``, ``q(Z)`` (the client's start)."""
    mb, vb = g.to_moments(q_beta)
    mz, vz = g.to_moments(q_z)
    return LocalQ(mb, 0.5 * jnp.log(vb), mz, 0.5 * jnp.log(vz))


def to_factors(lq: LocalQ, cav_beta: g.DiagGaussian, cav_z: g.DiagGaussian
               ) -> tuple[g.DiagGaussian, g.DiagGaussian]:
    """The client's new factors ``t_k = q_new / q_cavity`` in natural parameters."""
    qb = g.DiagGaussian.from_moments(lq.beta_loc, jnp.exp(2 * lq.beta_logsd))
    qz = g.DiagGaussian.from_moments(lq.z_loc, jnp.exp(2 * lq.z_logsd))
    return (cast(g.DiagGaussian, g.quotient(qb, cav_beta)),
            cast(g.DiagGaussian, g.quotient(qz, cav_z)))


def hvm_guide(lq: LocalQ, sample_beta: bool, sample_z: bool) -> None:
    """The guide: ``log_beta ~ N(beta_loc, e^beta_logsd)``, ``Z ~ N(z_loc, e^z_logsd)``, sampled
    directly (reparametrised) so that ``tempered(..., sites=["Z"])`` scales the Z entropy."""
    if sample_beta:
        numpyro.sample("log_beta", dist.Normal(lq.beta_loc, jnp.exp(lq.beta_logsd)).to_event(1))
    if sample_z:
        numpyro.sample("Z", dist.Normal(lq.z_loc, jnp.exp(lq.z_logsd)).to_event(2))
