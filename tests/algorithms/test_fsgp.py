from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedppl.algorithms import exact, fedavg, fsgp
from fedppl.models import gp, sparse_gp
from fedppl.models.kernels import SEParams
from fedppl.runtime import make_round

bound = jax.jit(fsgp.bound)
predict = jax.jit(fsgp.predict)
stats = jax.jit(fsgp.client_stats)
plausible = jax.jit(fsgp.plausible)


def _data(n=40, d=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-3, 3, size=(n, d))
    y = np.sin(X).sum(1) + 0.2 * rng.normal(size=n)
    return jnp.asarray(X), jnp.asarray(y)


def _params(Z, ls=(0.8, 1.3), var=1.5, noise=0.3):
    d = Z.shape[1]
    return fsgp.FSGPParams(SEParams(jnp.log(jnp.asarray(ls[:d])), jnp.log(jnp.asarray(var)),
                                    jnp.log(jnp.asarray(noise))), jnp.asarray(Z))


def _split(X, y, sizes):
    edges = np.cumsum([0, *sizes])
    return [(X[a:b], y[a:b]) for a, b in itertools.pairwise(edges)]


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
    k = lambda a, b: np.asarray(p.hyper.kernel(a, b))  # noqa: E731
    Z = np.asarray(p.inducing)
    Kmm = k(Z, Z) + jitter * np.eye(len(Z))
    Kmn, Ksm = k(Z, X), k(Xs, Z)
    s2 = float(p.hyper.noise_var)
    S = Kmm + Kmn @ Kmn.T / s2
    mean = Ksm @ np.linalg.solve(S, Kmn @ np.asarray(y)) / s2
    quad = np.einsum("ij,ji->i", Ksm, np.linalg.solve(Kmm, Ksm.T) - np.linalg.solve(S, Ksm.T))
    return mean, float(p.hyper.variance) + s2 - quad


# 1 ----------------------------------------------------------------------------------------------

def test_client_loss_gradient_ignores_padding():
    """Equal values for every parameter value imply equal gradients, so it suffices that the
    padding (NaN or huge) cannot leak into them."""
    X, y = _data(n=40)
    p = _params(X[::8])
    parts = _split(X, y, [7, 20, 13])
    data, masks = _padded(parts)
    huge, _ = _padded(parts, fill=1e3)
    grad = jax.jit(jax.grad(fsgp.client_loss))
    g_nan = grad(p, (data[0][0], data[1][0]), masks[0])
    g_huge = grad(p, (huge[0][0], huge[1][0]), masks[0])
    for a, b in zip(jax.tree_util.tree_leaves(g_nan), jax.tree_util.tree_leaves(g_huge),
                    strict=True):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    vb = jax.jit(jax.vmap(fsgp.bound, in_axes=(None, 0, 0, 0)))(p, *data, masks)
    np.testing.assert_allclose(vb, [float(bound(p, Xk, yk)) for Xk, yk in parts], rtol=1e-10)


def _sum(msgs):
    return exact.Stats(*(sum(m[i] for m in msgs) for i in range(3)))


# 3 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [[40], [10, 30], [5, 17, 3, 15]])
def test_prediction_from_sums_equals_centralised_sgpr(sizes):
    X, y = _data(n=40)
    Xs, _ = _data(n=25, seed=1)
    p = _params(X[:8] + 0.1)
    msgs = [stats(p, Xk, yk) for Xk, yk in _split(X, y, sizes)]
    mean, var = predict(p, _sum(msgs), Xs)
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
    # the clients whiten with the jitter the server predicts with
    msgs = [stats(p, Xk, yk, None, 1e-10) for Xk, yk in _split(X, y, [6, 9])]
    mean, var = predict(p, _sum(msgs), Xs, jitter=1e-10)
    ref_mean, ref_var = jax.jit(gp.predict)(p.hyper, X, y, Xs)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-6)
    np.testing.assert_allclose(var, ref_var + p.hyper.noise_var, atol=1e-6)


def test_whitened_statistics_keep_an_ill_conditioned_posterior_computable():
    """Almost noiseless data (noise sd 1e-3) and a large kernel variance (400): C_MM's condition
    number is about 1e10 (naval-propulsion-plant's regime). Whitening the plain sums on the
    server gives a q(u) that is not positive definite (NaN); the clients' whitened statistics
    give the function to 1e-3."""
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.uniform(-3, 3, (300, 1)))
    y = jnp.sin(X[:, 0]) + 1e-3 * jnp.asarray(rng.normal(size=300))
    p = _params(X[:30], ls=(3.0,), var=400.0, noise=1e-3)
    assert np.linalg.cond(np.asarray(fsgp.kuu(p))) > 1e9
    plain = exact.client_stats(p.hyper.kernel(X, p.inducing), y, jnp.ones(300))
    s2 = p.hyper.noise_var
    naive = sparse_gp.posterior_from_B(fsgp.kuu(p), plain.scatter / s2, plain.proj / s2)
    assert not bool(jnp.all(jnp.isfinite(naive.C)))
    msgs = [stats(p, Xk, yk) for Xk, yk in _split(X, y, [100, 200])]
    mean, var = predict(p, _sum(msgs), X[:50])
    assert bool(jnp.all(jnp.isfinite(var)))
    np.testing.assert_allclose(mean, jnp.sin(X[:50, 0]), atol=1e-3)


# 4 ----------------------------------------------------------------------------------------------

def _leaves_close(a, b, **kw):
    for x, z in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(x, z, **kw)


def test_trio_fedavg_round_rejects_a_nan_client_then_aggregates_statistics():
    X, y = _data(n=36)
    p0 = _params(X[:4])
    opt, steps, key = optax.adam(1e-2), 5, jax.random.key(3)
    round_fn = make_round(fsgp.make_trio(opt, steps), "synchronous")
    loss = lambda q, d, m, kk: fsgp.client_loss(q, d, m, kk)  # noqa: E731
    local = jax.jit(lambda d, m, k: fedavg.local_train(p0, loss, d, m, opt, steps, k)[0])

    # three clients, the middle one has a NaN target: rejected, the others averaged by N_k
    parts = _split(X, y, [10, 14, 12])
    parts[1] = (parts[1][0], parts[1][1].at[3].set(jnp.nan))
    data, masks = _padded(parts, fill=0.0)
    keys = jax.random.split(key, 3)
    everyone = jnp.ones(3, bool)
    state, _, msgs, ok = round_fn(fsgp.init(p0), (), data, masks, keys, everyone, key)
    np.testing.assert_array_equal(ok, [True, False, True])
    a, c = (local((data[0][k], data[1][k]), masks[k], keys[k]) for k in (0, 2))
    expected = jax.tree_util.tree_map(lambda u, v: (10 * u + 12 * v) / 22, a, c)
    _leaves_close(state.params, expected, rtol=1e-9)
    np.testing.assert_array_equal(msgs.stats.count, [10, 14, 12])  # FedAvg's weights
    assert float(jnp.abs(msgs.stats.scatter).max()) == 0.0  # no statistics while training

    # the aggregation phase: the server adds the plausible statistics (client b's are NaN)
    state = state._replace(phase=jnp.asarray(fsgp.AGGREGATE))
    state2, _, msgs, ok = round_fn(state, (), data, masks, keys, everyone, key)
    np.testing.assert_array_equal(ok, [True, False, True])
    _leaves_close(state2.params, state.params, rtol=0)
    want = [stats(state.params, *parts[k]) for k in (0, 2)]
    np.testing.assert_allclose(state2.stats.scatter, want[0].scatter + want[1].scatter,
                               atol=1e-10)
    assert float(state2.stats.count) == 22.0


# 5 ----------------------------------------------------------------------------------------------

def test_implausible_statistics_are_refused():
    X, y = _data(n=30)
    p = _params(X[:5])
    good = stats(p, X, y)
    assert bool(plausible(good))
    bad = [good._replace(scatter=good.scatter - 10.0 * jnp.eye(5)),        # not PSD
           good._replace(proj=good.proj.at[0].set(jnp.nan)),                 # not finite
           good._replace(scatter=good.scatter.at[0, 1].add(1.0)),            # not symmetric
           good._replace(count=jnp.asarray(-1.0))]                           # negative count
    assert [bool(plausible(b)) for b in bad] == [False] * 4
