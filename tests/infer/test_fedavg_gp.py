from __future__ import annotations

import jax
import numpy as np
import pytest

from fedppl import partition
from fedppl.algorithms import fsgp as alg
from fedppl.clients import Clients
from fedppl.infer.fedavg_gp import FSGPConfig, fit_fsgp


def _sine(n, seed):
    """The FSGP paper's 1-D set: f(x) = 3 sin(2 pi x / 20) on [-10, 10], noise sd 0.5."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-10, 10, size=n)
    return x[:, None], 3 * np.sin(2 * np.pi * x / 20) + 0.5 * rng.normal(size=n)


@pytest.fixture(scope="module")
def sine():
    X, y = _sine(150, 0)
    Xt, yt = _sine(100, 1)
    mx, sx, my, sy = X.mean(), X.std(), y.mean(), y.std()
    idx = [np.arange(0, 30), np.arange(30, 100), np.arange(100, 150)]  # unbalanced clients
    clients = partition.from_indices((X - mx) / sx, (y - my) / sy, idx)
    return clients, (Xt - mx) / sx, yt, my, sy


CFG = FSGPConfig(num_inducing=8, learning_rate=0.05, local_steps=20)


def test_end_to_end_improves_over_initial_params(sine):
    clients, Xt, yt, my, sy = sine
    seen = []
    start = fit_fsgp(clients, 0, CFG, key=jax.random.key(1))
    res = fit_fsgp(clients, 3, CFG, key=jax.random.key(1),
                   callback=lambda r, info: seen.append((r, info["bound"])))
    assert [r for r, _ in seen] == [1, 2, 3]
    assert res.history["round"] == [0, 1, 2, 3] and len(res.history["seconds"]) == 4
    assert res.history["bound"][0] == pytest.approx(start.history["bound"][0])
    assert res.history["bound"][-1] > res.history["bound"][0] + 10.0
    ll0, ll = start.log_likelihood(Xt, yt, my, sy), res.log_likelihood(Xt, yt, my, sy)
    assert ll > ll0 + 0.2, (ll0, ll)
    assert res.rmse(Xt, yt, my, sy) < 0.7  # noise sd is 0.5
    # inducing inputs were initialised at training inputs (the paper's choice)
    pooled = np.concatenate([clients.client(k)[0] for k in range(3)])
    Z0 = np.asarray(start.params.inducing)
    assert all(np.isclose(pooled, z).all(1).any() for z in Z0)
    # predict() is the server's DTC predictive from the clients' aggregated statistics
    msgs = [jax.jit(alg.client_stats)(res.params, *clients.client(k)) for k in range(3)]
    mean, var = jax.jit(alg.predict)(res.params, alg.aggregate(msgs), Xt)
    m2, v2 = res.predict(Xt)
    np.testing.assert_allclose(m2, mean, atol=1e-10)
    np.testing.assert_allclose(v2, var, atol=1e-10)
    # original units: the log-likelihood shifts by -log(sy), the RMSE scales by sy
    z = (yt - my) / sy
    assert res.log_likelihood(Xt, z) - np.log(sy) == pytest.approx(
        res.log_likelihood(Xt, yt, my, sy), abs=1e-9)
    assert res.rmse(Xt, z) * sy == pytest.approx(res.rmse(Xt, yt, my, sy), rel=1e-9)


def test_random_normal_inducing_and_zero_rounds(sine):
    clients, Xt, _, _, _ = sine
    res = fit_fsgp(clients, 0, CFG._replace(init_inducing="random-normal"), key=jax.random.key(0))
    Z = np.asarray(res.params.inducing)
    assert Z.shape == (8, 1) and abs(Z.mean()) < 1.5
    mean, var = res.predict(Xt)
    assert mean.shape == var.shape == (100,) and (np.asarray(var) > 0).all()
    assert float(res.stats.count) == 150


def test_bad_settings_raise_clear_errors(sine):
    clients = sine[0]
    tiny = Clients.from_list([(np.zeros((3, 1)), np.zeros(3)), (np.ones((2, 1)), np.ones(2))])
    with pytest.raises(ValueError, match="num_inducing = 8 exceeds .* N = 5"):
        fit_fsgp(tiny, 1, CFG)
    with pytest.raises(ValueError, match="init_inducing"):
        fit_fsgp(clients, 1, CFG._replace(init_inducing="kmeans"))
    with pytest.raises(ValueError, match="num_rounds"):
        fit_fsgp(clients, -1, CFG)
    three = Clients.from_list([(np.zeros((4, 1)), np.zeros(4), np.zeros(4))])
    with pytest.raises(ValueError, match=r"\(X \(N_k, D\), y \(N_k,\)\)"):
        fit_fsgp(three, 1, CFG._replace(num_inducing=2))
    with pytest.raises(ValueError, match=r"X must have shape \(n, 1\)"):
        fit_fsgp(clients, 0, CFG).predict(np.zeros((3, 2)))
