from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

import fedppl
from fedppl.infer.base import COMMON_HISTORY
from fedppl.infer.bayesian_regression import FedBNR, FedBNRResult
from fedppl.models.random_features import URKSpec

SPEC = URKSpec(1, feature_widths=(), shift_widths=(), num_samples=40)
TINY = URKSpec(1, feature_widths=(), shift_widths=(), num_samples=5)


def f(x):
    return np.sin(x[:, 0]) + 0.3 * x[:, 0]


@pytest.fixture(scope="module")
def two_ranges():
    """The paper's synthetic setting: one function, two clients on disjoint halves of [-5, 5]."""
    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(-5, 5, 200))[:, None]
    y = f(x) + 0.3 * rng.normal(size=200)
    clients = fedppl.Clients.from_list([(x[:100], y[:100]), (x[100:150], y[100:150])])
    xv = rng.uniform(-5, 5, (60, 1))
    return clients, (xv, f(xv))


@pytest.fixture(scope="module")
def results(two_ranges):
    """One run per kernel; each result holds both last layers."""
    clients, val = two_ranges
    return {kernel: FedBNR(SPEC, kernel=kernel, local_steps=20, eval_every=5).run(
        jax.random.key(0), clients, 10, progress_bar=False, validation=val)
        for kernel in ["avg", "local"]}


def _rmse(result, val, last_layer=None):
    mean, _ = result.predict(val[0], last_layer)
    return float(np.mean(np.sqrt(np.mean((np.asarray(mean) - val[1]) ** 2, axis=1))))


def test_global_model_beats_local_ones_across_the_range(results, two_ranges):
    _, val = two_ranges
    avg, local = results["avg"], results["local"]
    assert avg.num_models == 1 and local.num_models == 2  # local + global: one per kernel
    assert avg.predict(val[0], "local")[0].shape == (2, 60)
    fed = _rmse(avg, val)
    assert fed < 0.5 * _rmse(avg, val, "local")
    assert fed < 0.5 * _rmse(local, val, "local")
    assert np.isclose(avg.summary()["best_val_rmse"], fed)  # the kept model is the validated one


def test_one_shape_init_update_run_history_json_arviz(results, two_ranges, tmp_path):
    clients, val = two_ranges
    method = FedBNR(TINY, local_steps=3, eval_every=2)
    state = method.init(jax.random.key(0), clients, validation=val)
    state, info = method.update(state)
    assert info["round"] == 1 and info["messages_up"] == 2 and not info["evaluated"]
    state, info = method.update(state)
    assert info["evaluated"] and info["messages_up"] == 4  # the evaluation exchange
    assert info["bytes_up"] > 2 * 10 * 10 * 8  # the 10 x 10 scatter matrices came back
    res = results["avg"]
    assert isinstance(res, FedBNRResult)
    assert set(COMMON_HISTORY) | {"elbo", "val_rmse", "evaluated", "phase"} == set(res.history)
    h = res.history
    np.testing.assert_array_equal(h["round"], np.arange(1, 11))
    assert h["evaluated"].tolist() == [r % 5 == 0 for r in range(1, 11)]
    assert np.isnan(h["val_rmse"][0]) and np.isfinite(h["val_rmse"][4])
    assert np.all(np.isfinite(h["elbo"])) and h["elbo"][-1] > h["elbo"][0]
    out = res.to_json(str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["summary"] == out["summary"]
    assert out["summary"]["rounds_to_convergence"] is None and out["summary"]["best_round"]
    idata = res.to_arviz(jax.random.key(1), num_samples=48)
    assert idata.posterior["w"].shape == (4, 12, 1, 80)  # 4 chains of 12 draws
    assert idata.constant_data["noise"].shape == (1,)


def test_early_stopping_ends_phase_one_and_later_rounds_change_nothing(two_ranges):
    clients, val = two_ranges
    method = FedBNR(TINY, local_steps=30, eval_every=1, patience=1,
                    optimizer=optax.sgd(0.5))  # large steps: validation stops improving
    res = method.run(jax.random.key(0), clients, 30, progress_bar=False, validation=val)
    assert res.rounds_to_convergence == res.num_rounds < 30
    assert res.history["phase"][-1] == 2 and res.best_round == res.num_rounds - 1
    state = method.init(jax.random.key(0), clients, validation=val)
    while not bool(state.server.done):
        state, _ = method.update(state)
    later, info = method.update(state)
    assert info["messages_up"] == 0 and np.isnan(info["elbo"])
    for a, b in zip(jax.tree_util.tree_leaves((state.server.best, state.server.last_layer)),
                    jax.tree_util.tree_leaves((later.server.best, later.server.last_layer)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_without_validation_the_last_round_gives_the_model(two_ranges):
    clients, val = two_ranges
    res = FedBNR(TINY, local_steps=3, eval_every=5).run(jax.random.key(0), clients, 3,
                                                        progress_bar=False)
    assert res.num_rounds == 3 and res.best_round == 3 and res.rounds_to_convergence is None
    assert np.all(np.isnan(res.history["val_rmse"])) and res.history["evaluated"][-1]
    assert np.all(np.isfinite(res.predict(val[0])[1]))


def test_kd_variant_and_loop_schedule(two_ranges):
    clients, val = two_ranges
    xk = np.random.default_rng(1).uniform(-5, 5, (30, 1))
    runs = {schedule: FedBNR(TINY, kernel="kd", local_steps=10, kd_steps=10, eval_every=2,
                             schedule=schedule).run(jax.random.key(0), clients, 4,
                                                    progress_bar=False, validation=val,
                                                    kd_data=(xk, f(xk)))
            for schedule in ("synchronous", "loop")}
    mean, var = runs["synchronous"].predict(val[0])
    assert mean.shape == (1, 60) and np.all(np.asarray(var) > 0)
    assert runs["synchronous"].history["evaluated"].tolist() == [False, True, False, True]
    np.testing.assert_allclose(runs["loop"].predict(val[0])[0], mean, rtol=1e-9, atol=1e-12)


def test_central_pools_the_data(two_ranges):
    clients, val = two_ranges
    res = FedBNR(TINY, kernel="central", local_steps=3).run(jax.random.key(0), clients, 2,
                                                            progress_bar=False, validation=val)
    assert res.client_names == ("pooled",) and res.num_models == 1


def _clients_1d():
    return fedppl.Clients.from_list([(np.linspace(0, 1, 10), np.ones(10))])


def _clients_width(d):
    return fedppl.Clients.from_list([(np.ones((4, d)), np.ones(4))])


BAD_SETTINGS = [
    (dict(noise=-0.3), ValueError, "noise must be a positive finite number"),
    (dict(noise=0.0), ValueError, "noise must be a positive"),
    (dict(noise=float("nan")), ValueError, "noise must be a positive"),
    (dict(prior_scale=-1.0), ValueError, "prior_scale must be a positive"),
    (dict(prior_scale="1"), ValueError, "prior_scale must be a positive"),
    (dict(local_steps=0), ValueError, "local_steps must be a positive integer"),
    (dict(local_steps=2.5), ValueError, "local_steps must be a positive integer"),
    (dict(kd_steps=0), ValueError, "kd_steps must be a positive integer"),
    (dict(eval_every=0), ValueError, "eval_every must be a positive integer"),
    (dict(patience=-1), ValueError, "patience must be a positive integer"),
    (dict(kd_alpha=-1.0), ValueError, "kd_alpha must be a non-negative"),
    (dict(optimizer="adam"), TypeError, "optimizer must be an optax optimiser"),
    (dict(optimizer=1e-2), TypeError, "optimizer must be an optax optimiser"),
    (dict(kernel="fedprox"), ValueError, "kernel must be one of"),
    (dict(last_layer="personal"), ValueError, "last_layer must be one of"),
    (dict(kernel="central", last_layer="local"), ValueError, "its last layer is global"),
    (dict(schedule="sequential"), ValueError, "schedule must be one of"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_SETTINGS)
def test_bad_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        FedBNR(TINY, **kwargs)


def test_bad_spec_is_refused():
    with pytest.raises(TypeError, match="spec must be a URKSpec"):
        FedBNR((1, 5))


BAD_RUNS = [
    (dict(num_rounds=0), ValueError, "num_rounds must be a positive integer"),
    (dict(num_rounds=-2), ValueError, "num_rounds must be a positive integer"),
    (dict(num_rounds=2.5), TypeError, "num_rounds must be a positive integer"),
    (dict(num_rounds="3"), TypeError, "num_rounds must be a positive integer"),
    (dict(rng_key=0), TypeError, "rng_key must be a JAX key"),
    (dict(clients=[(np.ones((4, 1)), np.ones(4))]), TypeError, "clients must be a fedppl"),
    (dict(clients=_clients_1d), ValueError, r"inputs must have shape \(n, 1\).*X\[:, None\]"),
    (dict(clients=lambda: _clients_width(3)), ValueError, r"shape \(n, 1\), got \(4, 3\)"),
    (dict(clients=lambda: fedppl.Clients.from_list([(np.ones((4, 1)), np.ones((4, 2)))])),
     ValueError, r"targets must have shape \(4,\)"),
    (dict(clients=lambda: fedppl.Clients.from_list([(np.ones((4, 1)),)])), ValueError,
     "needs \\(X, y\\)"),
    (dict(validation=np.ones((4, 1))), TypeError, "validation must be a pair"),
    (dict(validation=(np.ones(4), np.ones(4))), ValueError, "validation: inputs must have"),
    (dict(validation=(np.full((4, 1), np.nan), np.ones(4))), ValueError, "finite"),
    (dict(validation=(np.ones((4, 1)), np.ones(3))), ValueError, r"targets must have shape"),
    (dict(validation=(np.ones((0, 1)), np.ones(0))), ValueError, "validation: no data"),
    (dict(kd_data=(np.ones((4, 1)), np.ones(4))), ValueError, "kd_data is used only by"),
    (dict(kernel="kd"), ValueError, "kernel='kd' needs kd_data"),
    (dict(kernel="kd", kd_data=(np.ones((4, 2)), np.ones(4))), ValueError, "kd_data: inputs"),
]


@pytest.mark.parametrize("change,error,match", BAD_RUNS)
def test_bad_runs_are_refused_before_compiling(change, error, match, two_ranges):
    clients, _ = two_ranges
    args = dict(rng_key=jax.random.key(0), clients=clients, num_rounds=2)
    change = dict(change)
    kernel = change.pop("kernel", "avg")
    args.update({k: v() if callable(v) else v for k, v in change.items()})
    method = FedBNR(TINY, kernel=kernel, local_steps=2)
    with pytest.raises(error, match=match):
        method.run(args.pop("rng_key"), args.pop("clients"), args.pop("num_rounds"),
                   progress_bar=False, **args)
    assert not hasattr(method, "_round_fn")  # nothing was compiled


def test_nan_client_data_is_refused_by_clients():
    with pytest.raises(ValueError, match="NaN or infinite"):
        fedppl.Clients.from_list([(np.array([[np.nan], [1.0]]), np.ones(2))])


@pytest.mark.parametrize("X,error,match", [
    (np.ones(5), ValueError, r"shape \(n, 1\), got \(5,\)"),
    (np.ones((5, 2)), ValueError, r"shape \(n, 1\), got \(5, 2\)"),
    (np.array([[np.inf]]), ValueError, "finite"),
    (np.array([["a"]]), TypeError, "numbers"),
])
def test_bad_prediction_inputs(results, X, error, match):
    with pytest.raises(error, match=match):
        results["avg"].predict(X)
    with pytest.raises(ValueError, match="last_layer must be one of"):
        results["avg"].predict(np.ones((2, 1)), "both")
