from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedppl.algorithms import exact, fedavg
from fedppl.algorithms import fsgp
from fedppl.models import gp

bound = jax.jit(fsgp.collapsed_bound)
predict = jax.jit(fsgp.predict)
stats = jax.jit(fsgp.client_stats)


def _data(n=40, d=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-3, 3, size=(n, d))
    y = np.sin(X).sum(1) + 0.2 * rng.normal(size=n)
    return jnp.asarray(X), jnp.asarray(y)


def _params(Z, ls=(0.8, 1.3), var=1.5, noise=0.3):
    d = Z.shape[1]
    return fsgp.FSGPParams(jnp.log(jnp.asarray(ls[:d])), jnp.log(jnp.asarray(var)),
                           jnp.log(jnp.asarray(noise)), jnp.asarray(Z))


def _gp_params(p):
    return gp.GPParams(p.log_lengthscale, p.log_variance, p.log_noise)


def _split(X, y, sizes):
    edges = np.cumsum([0] + list(sizes))
    return [(X[a:b], y[a:b]) for a, b in zip(edges[:-1], edges[1:])]


def _padded(parts, fill=np.nan):
    """Stack clients with ``fill`` (default NaN) in the padding rows, plus masks."""
    n = max(len(p[1]) for p in parts)
    Xs, ys, ms = [], [], []
    for X, y in parts:
        k = len(y)
        Xs.append(np.concatenate([X, np.full((n - k, X.shape[1]), fill)]))
        ys.append(np.concatenate([y, np.full(n - k, fill)]))
        ms.append(np.arange(n) < k)
    return (jnp.asarray(np.stack(Xs)), jnp.asarray(np.stack(ys))), jnp.asarray(np.stack(ms))


def _naive_dtc(p, X, y, Xs, jitter):
    """Centralised SGPR/DTC predictive (Eqs. 12-13) by direct dense solves in numpy."""
    k = lambda a, b: np.asarray(fsgp._kernel(p, a, b))  # noqa: E731
    Z = np.asarray(p.inducing)
    Kmm = k(Z, Z) + jitter * np.eye(len(Z))
    Kmn, Ksm = k(Z, X), k(Xs, Z)
    s2 = float(p.noise_var)
    S = Kmm + Kmn @ Kmn.T / s2
    mean = Ksm @ np.linalg.solve(S, Kmn @ np.asarray(y)) / s2
    quad = np.einsum("ij,ji->i", Ksm, np.linalg.solve(Kmm, Ksm.T) - np.linalg.solve(S, Ksm.T))
    return mean, float(p.variance) + s2 - quad


# 1 ----------------------------------------------------------------------------------------------

def test_bound_is_exact_marginal_at_z_equal_x_and_below_it_otherwise():
    X, y = _data(n=15, d=1)
    p = _params(X, ls=(1.0,))
    exact_lml = -float(jax.jit(gp.neg_log_marginal)(_gp_params(p), X, y))
    full = float(bound(p, X, y, jitter=1e-10))
    assert abs(full - exact_lml) < 1e-6
    for seed in range(3):
        idx = np.random.default_rng(seed).choice(15, 5, replace=False)
        sub = float(bound(p._replace(inducing=X[idx]), X, y, jitter=1e-10))
        assert sub < exact_lml - 1e-3  # a strict gap: 5 points cannot represent the function


def test_bound_matches_dense_formula():
    X, y = _data(n=30)
    p = _params(X[:6])
    K = np.asarray(fsgp._kernel(p, X, X))
    Knm = np.asarray(fsgp._kernel(p, X, p.inducing))
    Q = Knm @ np.linalg.solve(np.asarray(fsgp.kuu(p)), Knm.T)
    s2 = float(p.noise_var)
    C = Q + s2 * np.eye(30)
    yn = np.asarray(y)
    logN = -0.5 * (np.linalg.slogdet(2 * np.pi * C)[1] + yn @ np.linalg.solve(C, yn))
    dense = logN - np.trace(K - Q) / (2 * s2)
    np.testing.assert_allclose(float(bound(p, X, y)), dense, rtol=1e-9)


# 2 ----------------------------------------------------------------------------------------------

def test_per_client_bound_respects_masks_and_nan_padding():
    X, y = _data(n=40)
    p = _params(X[::8])
    parts = _split(X, y, [7, 20, 13])
    data, masks = _padded(parts)
    vb = jax.jit(jax.vmap(fsgp.collapsed_bound, in_axes=(None, 0, 0, 0)))(p, *data, masks)
    alone = [float(bound(p, Xk, yk)) for Xk, yk in parts]
    np.testing.assert_allclose(vb, alone, rtol=1e-10)
    # the local training signal too: equal values for every parameter value imply equal
    # gradients, so it suffices that the padding (NaN or huge) cannot leak into them
    grad = jax.jit(jax.grad(fsgp.client_loss))
    huge, _ = _padded(parts, fill=1e3)
    g_nan = grad(p, (data[0][0], data[1][0]), masks[0])
    g_huge = grad(p, (huge[0][0], huge[1][0]), masks[0])
    for a, b in zip(g_nan, g_huge):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    vh = jax.jit(jax.vmap(fsgp.collapsed_bound, in_axes=(None, 0, 0, 0)))(p, *huge, masks)
    np.testing.assert_allclose(vh, alone, rtol=1e-10)


# 3 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[40], [10, 30], [5, 17, 3, 15]])
def test_prediction_from_sums_equals_centralised_sgpr(sizes):
    X, y = _data(n=40)
    Xs, _ = _data(n=25, seed=1)
    p = _params(X[:8] + 0.1)
    msgs = [stats(p, Xk, yk) for Xk, yk in _split(X, y, sizes)]
    mean, var = predict(p, fsgp.aggregate(msgs), Xs)
    ref_mean, ref_var = _naive_dtc(p, np.asarray(X), y, np.asarray(Xs), fsgp.DEFAULT_JITTER)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-8)
    np.testing.assert_allclose(var, ref_var, atol=1e-8)
    # padded + masked statistics (NaN padding) give the same message
    data, masks = _padded(_split(X, y, sizes))
    padded = jax.jit(jax.vmap(fsgp.client_stats, in_axes=(None, 0, 0, 0)))(p, *data, masks)
    np.testing.assert_allclose(padded.scatter.sum(0), sum(m.scatter for m in msgs), atol=1e-10)
    np.testing.assert_allclose(padded.proj.sum(0), sum(m.proj for m in msgs), atol=1e-10)
    np.testing.assert_array_equal(padded.count, sizes)


def test_prediction_with_z_equal_x_is_the_exact_gp():
    X, y = _data(n=15, d=1)
    Xs, _ = _data(n=10, d=1, seed=2)
    p = _params(X, ls=(1.0,))
    msgs = [stats(p, Xk, yk) for Xk, yk in _split(X, y, [6, 9])]
    mean, var = predict(p, fsgp.aggregate(msgs), Xs, jitter=1e-10)
    ref_mean, ref_var = jax.jit(gp.predict)(_gp_params(p), X, y, Xs)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-6)
    np.testing.assert_allclose(var, ref_var + p.noise_var, atol=1e-6)


# 4 ----------------------------------------------------------------------------------------------

def _leaves_close(a, b, **kw):
    for x, z in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, z, **kw)


def test_fedavg_round_one_client_and_rejection_of_a_nan_client():
    X, y = _data(n=36)
    p0 = _params(X[:4])
    opt, steps, key = optax.adam(1e-2), 5, jax.random.key(3)
    round_fn = fsgp.make_round(opt, steps)
    loss = lambda q, d, m, kk: fsgp.client_loss(q, d, m, kk)  # noqa: E731
    local = jax.jit(lambda d, m, k: fedavg.local_train(p0, loss, d, m, opt, steps, k)[0])

    # one client: the average is that client's locally trained parameters
    state, ok, bounds = round_fn(fedavg.init(p0), (X[None], y[None]), jnp.ones((1, 36), bool), key)
    _leaves_close(state.params, local((X, y), jnp.ones(36, bool), key), rtol=1e-10)
    assert bool(ok[0]) and np.isfinite(bounds).all()

    # three clients, the middle one has a NaN target: rejected by name, the others averaged
    parts = _split(X, y, [10, 14, 12])
    parts[1] = (parts[1][0], parts[1][1].at[3].set(jnp.nan))
    data, masks = _padded(parts + [(X, y)], fill=0.0)  # 4th row only fixes the padded length
    state, ok, _ = round_fn(fedavg.init(p0), (data[0][:3], data[1][:3]), masks[:3], key)
    np.testing.assert_array_equal(ok, [True, False, True])
    with pytest.warns(RuntimeWarning, match="client b"):
        assert fsgp.rejected_names(ok, ["client a", "client b", "client c"]) == ["client b"]
    a, c = (local((data[0][k], data[1][k]), masks[k], key) for k in (0, 2))
    expected = jax.tree_util.tree_map(lambda u, v: (10 * u + 12 * v) / 22, a, c)
    _leaves_close(state.params, expected, rtol=1e-9)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree_util.tree_leaves(state.params))


# 5 ----------------------------------------------------------------------------------------------

def test_bad_statistics_are_rejected_naming_the_client():
    X, y = _data(n=30)
    p = _params(X[:5])
    msgs = [stats(p, Xk, yk) for Xk, yk in _split(X, y, [10, 10, 10])]
    names = ["hospital A", "hospital B", "hospital C"]
    fsgp.aggregate(msgs, names)  # fine
    not_psd = msgs[2]._replace(scatter=msgs[2].scatter - 10.0 * jnp.eye(5))
    with pytest.raises(ValueError, match="hospital C.*positive semi-definite"):
        fsgp.aggregate([msgs[0], msgs[1], not_psd], names)
    nan_b = msgs[1]._replace(proj=msgs[1].proj.at[0].set(jnp.nan))
    with pytest.raises(ValueError, match="hospital B.*non-finite"):
        fsgp.aggregate([msgs[0], nan_b, msgs[2]], names)
    wrong = exact.Stats(jnp.eye(4), jnp.zeros(4), jnp.asarray(3))
    with pytest.raises(ValueError, match="hospital B.*shapes"):
        fsgp.aggregate([msgs[0], wrong], names[:2])
    asym = msgs[0]._replace(scatter=msgs[0].scatter.at[0, 1].add(1.0))
    with pytest.raises(ValueError, match="hospital A.*symmetric"):
        fsgp.aggregate([asym], names[:1])
