"""Kronecker and Tucker algebra against dense products (float64)."""

from __future__ import annotations

import numpy as np

from fedppl.families import kronecker as kr


def test_products_equal_dense():
    rng = np.random.default_rng(0)
    A = [rng.normal(size=s) for s in [(2, 3), (4, 2), (3, 3)]]     # rectangular: Tucker factors
    v = rng.normal(size=18)
    np.testing.assert_allclose(kr.kron_matvec(A, v), np.kron(np.kron(A[0], A[1]), A[2]) @ v,
                               rtol=1e-12)
    np.testing.assert_allclose(kr.kron_matvec(A, v.reshape(3, 2, 3)), kr.kron_dense(A) @ v,
                               rtol=1e-12)
    rows = [rng.normal(size=(5, q)) for q in (3, 2, 3)]
    dense_rows = kr.kron_rows(rows)
    assert dense_rows.shape == (5, 18)
    np.testing.assert_allclose(dense_rows[1], np.kron(np.kron(rows[0][1], rows[1][1]),
                                                      rows[2][1]), rtol=1e-12)
    np.testing.assert_allclose(kr.contract_rows(v, rows), dense_rows @ v, rtol=1e-12)
    G = [B @ B.T for B in (rng.normal(size=(q, q)) for q in (3, 2, 3))]
    np.testing.assert_allclose(kr.tucker_quadratic(v, G), v @ kr.kron_dense(G) @ v, rtol=1e-12)
    vecs = [rng.normal(size=q) for q in (3, 2, 3)]
    np.testing.assert_allclose(kr.kron_vectors(vecs), np.kron(np.kron(*vecs[:2]), vecs[2]))


def test_logdet_is_the_corrected_eq_2_4():
    rng = np.random.default_rng(1)
    A = [B @ B.T + np.eye(len(B)) for B in (rng.normal(size=(m, m)) for m in (2, 3, 4))]
    logdets = [np.linalg.slogdet(a)[1] for a in A]
    dense = np.linalg.slogdet(kr.kron_dense(A))[1]
    assert abs(float(kr.kron_logdet(logdets, [2, 3, 4])) - dense) < 1e-10 * abs(dense)
    wrong = sum(m * ld for m, ld in zip((2, 3, 4), logdets, strict=True))   # Eq. 2.4 as printed
    assert abs(wrong - dense) > 1.0
    assert kr.grid_size([100] * 5) == 10**10


def test_one_minus_prod_keeps_tiny_differences():
    x = np.array([3e-11, 1e-12, 2e-10])
    exact = x.sum() - (x[0] * x[1] + x[0] * x[2] + x[1] * x[2]) + x.prod()
    assert abs(float(kr.one_minus_prod(x)) - exact) < 1e-14 * exact
    assert abs((1.0 - np.prod(1.0 - x)) - exact) > 1e-8 * exact       # the naive form loses it
    big = np.array([0.5, 0.9])
    np.testing.assert_allclose(kr.one_minus_prod(big), 1 - 0.5 * 0.1, rtol=1e-14)
