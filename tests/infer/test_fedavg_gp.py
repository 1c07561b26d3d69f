"""FSGP: FedAvg of the Titsias bound, then the aggregation round, through the one front."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

from fedppl import partition
from fedppl.algorithms import exact
from fedppl.algorithms import fsgp as alg
from fedppl.clients import Clients
from fedppl.infer.base import COMMON_HISTORY
from fedppl.infer.fedavg_gp import FSGP, FSGPConfig, FSGPResult


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


CFG = FSGPConfig(num_inducing=8, optimizer=optax.adam(0.05), local_steps=20)


@pytest.fixture(scope="module")
def fitted(sine):
    front = FSGP(CFG)
    return front, front.run(jax.random.key(1), sine[0], 3, progress_bar=False)


def test_a_prediction_that_is_not_finite_is_a_clear_error(fitted):
    """Statistics with which q(u) is not positive definite (here: a negative scatter): an error
    naming the conditioning and the jitter, not NaN means that surface later in a metric."""
    _, res = fitted
    M = res.params.inducing.shape[0]
    bad = dataclasses.replace(res, stats=res.stats._replace(scatter=-1e6 * np.eye(M)))
    with pytest.raises(FloatingPointError, match=r"not finite.*condition number.*jitter"):
        bad.predict(np.zeros((2, 1)))
    with pytest.raises(FloatingPointError, match="not finite"):
        bad.log_likelihood(np.zeros((2, 1)), np.zeros(2))
    assert np.all(np.isfinite(np.asarray(res.predict(np.zeros((2, 1)))[0])))


def _start(front, clients):
    """The result at the initial parameters: init, then straight to the aggregation round."""
    state = front.init(jax.random.key(1), clients)
    state, _ = front.aggregate(state)
    return FSGPResult(params=state.server.params, stats=state.server.stats,
                      history={"bound": np.zeros(1), "round": np.ones(1)})


def test_end_to_end_improves_over_initial_params(sine, fitted):
    clients, Xt, yt, my, sy = sine
    front, res = fitted
    start = _start(front, clients)
    h = res.history
    assert set(COMMON_HISTORY) | {"bound"} <= set(h)
    assert h["round"].tolist() == [1, 2, 3] and len(h["seconds"]) == 3  # round 1 first
    (X, y), masks = clients.stacked, clients.mask
    bound0 = float(sum(alg.bound(start.params, X[k], y[k], masks[k]) for k in range(3)))
    assert h["bound"][-1] > bound0 + 10.0
    ll0, ll = start.log_likelihood(Xt, yt, my, sy), res.log_likelihood(Xt, yt, my, sy)
    assert ll > ll0 + 0.2, (ll0, ll)
    assert res.rmse(Xt, yt, my, sy) < 0.7  # noise sd is 0.5
    # inducing inputs were initialised at training inputs (the paper's choice)
    pooled = np.concatenate([clients.client(k)[0] for k in range(3)])
    Z0 = np.asarray(start.params.inducing)
    assert all(np.isclose(pooled, z).all(1).any() for z in Z0)
    # predict() is the server's DTC predictive from the clients' summed statistics
    msgs = [jax.jit(alg.client_stats)(res.params, *clients.client(k)) for k in range(3)]
    total = exact.Stats(*(sum(m[i] for m in msgs) for i in range(3)))
    mean, var = jax.jit(alg.predict)(res.params, total, Xt)
    m2, v2 = res.predict(Xt)
    np.testing.assert_allclose(m2, mean, atol=1e-10)
    np.testing.assert_allclose(v2, var, atol=1e-10)
    assert float(res.stats.count) == 150
    # original units: the log-likelihood shifts by -log(sy), the RMSE scales by sy
    z = (yt - my) / sy
    assert res.log_likelihood(Xt, z) - np.log(sy) == pytest.approx(
        res.log_likelihood(Xt, yt, my, sy), abs=1e-9)
    assert res.rmse(Xt, z) * sy == pytest.approx(res.rmse(Xt, yt, my, sy), rel=1e-9)


def test_aggregation_round_is_counted_and_reported(fitted, tmp_path):
    res = fitted[1]
    agg = res.aggregation
    assert agg["messages_up"] == 3 and agg["rejected"] == 0
    M = 8
    assert agg["bytes_up"] == 3 * (M * (M + 1) // 2 + M + 1) * 8
    s = res.summary()
    assert s["messages_up"] == 3 * 3 + 3 and s["rounds"] == 3
    assert s["rounds_to_convergence"] == res.rounds_to_convergence() >= 1
    out = res.to_json(str(tmp_path / "fsgp.json"))
    assert json.loads((tmp_path / "fsgp.json").read_text())["summary"] == out["summary"]
    assert out["method"] == "FSGP" and "rounds_to_convergence" in out["summary"]
    idata = res.to_arviz(jax.random.key(0), num_samples=40)
    assert idata.posterior["u"].shape == (4, 10, M)  # 4 chains of 10 draws
    assert idata.constant_data["Z"].shape == (M, 1)
    assert np.all(idata.constant_data["noise"].values > 0)


def test_random_normal_inducing_and_init_update(sine, fitted):
    clients = sine[0]
    front = fitted[0]
    # the same front (its compiled round) with the other initialisation
    front.config = front.config._replace(init_inducing="random-normal")
    try:
        state = front.init(jax.random.key(0), clients)
        state, info = front.update(state)
    finally:
        front.config = front.config._replace(init_inducing="client-data")
    assert info["round"] == 1 and info["messages_up"] == 3 and np.isfinite(info["bound"])
    state, agg = front.aggregate(state)
    assert agg["refused"] == [] and float(state.server.stats.count) == 150
    # Z ~ N(0, I) from the first half of the run's key (the key stream of the old fit_fsgp),
    # moved by one round of training
    Z0 = jax.random.normal(jax.random.split(jax.random.key(0))[0], (8, 1))
    Z = np.asarray(state.server.params.inducing)
    assert Z.shape == (8, 1) and 0 < np.abs(Z - Z0).max() < 0.5


TINY = Clients.from_list([(np.zeros((3, 1)), np.zeros(3)), (np.ones((2, 1)), np.ones(2))])
BAD = [
    ({"num_inducing": 0}, ValueError, "num_inducing"),
    ({"num_inducing": 8.0}, TypeError, "num_inducing"),
    ({"local_steps": -1}, ValueError, "local_steps"),
    ({"optimizer": "adam"}, TypeError, "optimizer"),
    ({"optimizer": None}, TypeError, "optimizer"),
    ({"init_lengthscale": 0.0}, ValueError, "init_lengthscale"),
    ({"init_variance": -1.0}, ValueError, "init_variance"),
    ({"init_noise": -0.1}, ValueError, "init_noise"),
    ({"init_noise": float("inf")}, ValueError, "init_noise"),
    ({"jitter": -1e-6}, ValueError, "jitter"),
    ({"init_inducing": "kmeans"}, ValueError, "init_inducing"),
    ({"learning_rate": 0.01}, TypeError, "unknown settings.*learning_rate"),
]


@pytest.mark.parametrize("settings, error, match", BAD, ids=[next(iter(b[0])) for b in BAD])
def test_bad_settings_raise_clear_errors(settings, error, match):
    with pytest.raises(error, match=match):
        FSGP(CFG, **settings)


BAD_RUNS = [
    (TINY, 1, ValueError, "num_inducing = 8 exceeds .* N = 5"),
    (None, -1, ValueError, "num_rounds"),
    (None, 0, ValueError, "num_rounds"),
    (None, True, TypeError, "num_rounds"),
    (Clients.from_list([(np.zeros((4, 1)), np.zeros(4), np.zeros(4))]), 1, ValueError,
     "got 3 arrays"),
    (Clients.from_list([(np.zeros(9), np.zeros(9))]), 1, ValueError, r"shape \(N, D\)"),
    ([(np.zeros((9, 1)), np.zeros(9))], 1, TypeError, "fedppl.Clients"),
]


@pytest.mark.parametrize("clients, rounds, error, match", BAD_RUNS,
                         ids=[str(i) for i in range(len(BAD_RUNS))])
def test_bad_runs_raise_before_anything_runs(sine, clients, rounds, error, match):
    with pytest.raises(error, match=match):
        FSGP(CFG).run(jax.random.key(0), sine[0] if clients is None else clients, rounds,
                      progress_bar=False)


def test_bad_key_and_test_inputs(sine, fitted):
    with pytest.raises(TypeError, match="rng_key"):
        FSGP(CFG).run(0, sine[0], 1)
    res = fitted[1]
    with pytest.raises(ValueError, match=r"X must have shape \(n, 1\)"):
        res.predict(np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"y must have shape \(3,\)"):
        res.rmse(np.zeros((3, 1)), np.zeros(4))
    with pytest.raises(ValueError, match="y_std"):
        res.log_likelihood(np.zeros((3, 1)), np.zeros(3), y_std=0.0)
