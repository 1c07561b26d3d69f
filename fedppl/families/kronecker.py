"""Kronecker and Tucker algebra: products with ``A = A_1 ⊗ ... ⊗ A_p`` without forming ``A``.

A vector of length ``M = m_1 ... m_p`` is read as a tensor of shape ``(m_1, ..., m_p)`` in
row-major order (the last index runs fastest), the order of ``jnp.kron``. Then

* :func:`kron_matvec` is Saatci's ``kron_mvprod``: ``(A_1 ⊗ ... ⊗ A_p) v`` by one mode product per
  factor, ``O(M sum_l m_l)`` instead of ``O(M^2)``; factors may be rectangular, so a Tucker tensor
  ``W x_1 U_1 ... x_p U_p`` is ``kron_matvec(U, W)`` (Eqs. 2.6, 2.20-2.21 of the thesis) and the
  Tucker-Kronecker identity ``(⊗ A_l)(W x_l U_l) = W x_l (A_l U_l)`` is ``kron_matvec`` applied to
  the products ``A_l U_l``;
* :func:`contract_rows` is ``k_i' v`` for Kronecker rows ``k_i = k_i1 ⊗ ... ⊗ k_ip`` of many points
  at once (a tensor contracted with one vector per mode);
* :func:`kron_logdet` is ``log|⊗ A_l| = sum_l (M / m_l) log|A_l|`` (the corrected Eq. 2.4);
* :func:`one_minus_prod` is ``1 - prod_l (1 - x_l)`` through ``log1p``/``expm1``: the trace and
  Nyström terms of the Kronecker bound are differences of numbers near 1 (see the thesis digest).

Example::

    >>> import jax.numpy as jnp
    >>> A, B = jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[0.0, 1.0], [1.0, 1.0]])
    >>> v = jnp.arange(4.0)
    >>> bool(jnp.allclose(kron_matvec([A, B], v), jnp.kron(A, B) @ v))
    True
    >>> float(kron_logdet([jnp.log(2.0), jnp.log(3.0)], [2, 2])) == float(jnp.log(36.0))
    True
    >>> x = jnp.array([1e-12, 1e-12], dtype=jnp.float32)
    >>> f"{float(one_minus_prod(x)):.3g}", float(1.0 - jnp.prod(1.0 - x))  # naive: all lost
    ('2e-12', 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce

import jax.numpy as jnp
from jax import Array

__all__ = ["grid_size", "kron_matvec", "kron_dense", "kron_vectors", "contract_rows",
           "kron_rows", "tucker_quadratic", "kron_logdet", "one_minus_prod"]


def grid_size(sizes: Sequence[int]) -> int:
    """``M = prod_l m_l`` as a Python integer (exact beyond float precision)."""
    return math.prod(int(m) for m in sizes)


def kron_matvec(factors: Sequence[Array], v: Array) -> Array:
    """``(A_1 ⊗ ... ⊗ A_p) v`` for ``A_l`` of shape ``(r_l, n_l)`` and ``v`` with ``prod n_l``
    entries (flat or shaped ``(n_1, ..., n_p)``); returns a vector of length ``prod r_l``.

    Saatci's algorithm: multiply the leading mode by ``A_l`` as a matrix product with
    ``(n_l, rest)`` and move it to the back; after ``p`` steps the modes are back in order. Only
    2-D products and transposes (XLA compiles high-rank transposes very slowly);
    ``O(prod(n) sum_l r_l)`` for square factors."""
    t = jnp.reshape(v, (-1,))
    for A in factors:
        t = (A @ t.reshape(A.shape[1], -1)).T.reshape(-1)
    return t


def kron_dense(factors: Sequence[Array]) -> Array:
    """``A_1 ⊗ ... ⊗ A_p`` formed densely (for tests and small grids only)."""
    return reduce(jnp.kron, factors)


def kron_vectors(vectors: Sequence[Array]) -> Array:
    """``a_1 ⊗ ... ⊗ a_p`` for vectors (a rank-one tensor, flattened): ``O(M)``."""
    return reduce(jnp.kron, vectors)


def contract_rows(tensor: Array, rows: Sequence[Array]) -> Array:
    """``t_i = T x_1 r_i1 x_2 ... x_p r_ip`` for every point ``i``: the inner products
    ``(r_i1 ⊗ ... ⊗ r_ip)' vec(T)`` of ``b`` Kronecker rows with one tensor.

    ``tensor`` has ``prod q_l`` entries (flat or shaped ``(q_1, ..., q_p)``), ``rows[l]`` is
    ``(b, q_l)``. Cost ``O(b prod q_l)``: no ``(b, prod q_l)`` matrix is formed.
    """
    b = rows[0].shape[0]
    t = rows[0] @ jnp.reshape(tensor, (rows[0].shape[1], -1))          # (b, q_2 ... q_p)
    for r in rows[1:]:
        t = jnp.einsum("bi,bir->br", r, t.reshape(b, r.shape[1], -1))
    return t.reshape(b)


def kron_rows(rows: Sequence[Array]) -> Array:
    """The ``(b, prod q_l)`` matrix of Kronecker rows formed densely (tests, small grids)."""
    out = rows[0]
    for r in rows[1:]:
        out = (out[:, :, None] * r[:, None, :]).reshape(out.shape[0], -1)
    return out


def tucker_quadratic(core: Array, grams: Sequence[Array]) -> Array:
    """``W' (G_1 ⊗ ... ⊗ G_p) W`` for a core ``W`` with ``prod q_l`` entries and ``q_l x q_l``
    matrices ``G_l`` (e.g. ``U_l' K_l U_l``): ``O(prod(q) sum_l q_l)``."""
    w = jnp.reshape(core, -1)
    return jnp.dot(w, kron_matvec(grams, w))


def kron_logdet(logdets: Sequence[Array] | Array, sizes: Sequence[int]) -> Array:
    """``log|A_1 ⊗ ... ⊗ A_p| = sum_l (M / m_l) log|A_l|`` with ``M = prod m_l``.

    (The thesis's Eq. 2.4 writes ``sum_l m_l log|A_l|``; the multiplicity of each factor is the
    product of the other sizes.)"""
    total = grid_size(sizes)
    terms = [float(total // int(m)) * jnp.asarray(ld) for m, ld in zip(sizes, logdets, strict=True)]
    return jnp.sum(jnp.stack(terms))


def one_minus_prod(x: Array) -> Array:
    """``1 - prod_l (1 - x_l)`` over the last axis, accurate when every ``x_l`` is tiny (no
    cancellation of two numbers near 1): ``-expm1(sum_l log1p(-x_l))``."""
    return -jnp.expm1(jnp.sum(jnp.log1p(-x), axis=-1))
