from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

import fedppl
from fedppl.algorithms import cotraining as ct
from fedppl.infer.base import COMMON_HISTORY

K_ROUNDS = 2


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(3)

    def draw(n):
        y = rng.normal(size=n)
        return [(0.9 * y + 0.4 * rng.normal(size=n))[:, None] for _ in range(2)], y

    (x1, _), y1 = draw(14)
    (_, x2), y2 = draw(14)
    pool, _ = draw(12)
    test, y_test = draw(25)
    clients = fedppl.Clients.from_list([(x1, y1), (x2, y2)], names=["north", "south"])
    return {"clients": clients, "pool": pool, "test": test, "y_test": y_test}


def inputs(problem):
    return {k: problem[k] for k in ("pool", "test", "y_test")}


@pytest.fixture(scope="module")
def result(problem):
    dp = ct.DPSettings(1.0, 0.01, sensitivity="rkhs")
    return fedppl.CoTraining("noisy", "full", dp, fit_steps=30).run(
        jax.random.key(0), problem["clients"], K_ROUNDS, progress_bar=False, **inputs(problem))


def test_init_update_run_share_one_shape(problem, result):
    method = fedppl.CoTraining("noisy", "full", ct.DPSettings(1.0, 0.01, sensitivity="rkhs"),
                               fit_steps=30)
    state = method.init(jax.random.key(0), problem["clients"], **inputs(problem))
    assert state.round == 0 and state.server == ct.Relay()
    for r in range(1, K_ROUNDS + 1):
        state, info = method.update(state)
        assert info["round"] == r == state.round
        assert info["messages_up"] == 4 and info["messages_down"] == 4  # 2 + 2 up; 2 + 2 down
        assert info["bytes_up"] > 0 and info["bytes_down"] > 0 and info["rejected"] == 0
    # update by hand is run: the same keys, the same releases
    np.testing.assert_allclose(info["epsilon"], result.history["epsilon"][-1])
    np.testing.assert_allclose(info["rmse"], result.history["rmse"][-1])


def test_history_json_and_summary(result):
    h = result.history
    assert set(COMMON_HISTORY) <= set(h) and {"rmse", "epsilon"} <= set(h)
    assert h["round"].tolist() == list(range(1, K_ROUNDS + 1))
    assert h["rmse"].shape == h["epsilon"].shape == (K_ROUNDS, 2)
    out = json.loads(json.dumps(result.to_json()))
    assert set(out) == {"method", "summary", "history", "rejected"}
    assert out["method"] == "CoTraining" and out["summary"]["rounds"] == K_ROUNDS
    assert out["summary"]["epsilon"] == result.epsilon and len(out["summary"]["rmse_before"]) == 2
    assert result.client_names == ("north", "south")


def test_predict_before_and_after(problem, result):
    test, y_test = problem["test"], problem["y_test"]
    for k, name in enumerate(result.client_names):
        mean, var = result.predict(name, test[k])
        assert mean.shape == var.shape == (25,) and np.all(var > 0)
        assert fedppl.metrics.rmse(y_test, mean) == pytest.approx(result.rmse_after[k])
        alone, _ = result.predict(k, test[k], alone=True)
        assert fedppl.metrics.rmse(y_test, alone) == pytest.approx(result.rmse_before[k])
    assert result.queried("south") == [int(i) for i in result.parties[1].got_index[0]]
    with pytest.raises(IndexError, match="party must be"):
        result.predict(2, test[0])
    with pytest.raises(KeyError, match="no party named"):
        result.predict("east", test[0])
    with pytest.raises(ValueError, match="columns"):
        result.predict(0, np.ones((3, 2)))


def test_to_arviz_holds_predictive_summaries(result):
    idata = result.to_arviz(jax.random.key(0), num_samples=400)
    assert idata.predictions["mean"].shape == (2, 25)
    f = idata.posterior["f"]  # draws of each party's latent at the test points, 4 chains
    assert f.dims == ("chain", "draw", "client", "point") and f.shape == (4, 100, 2, 25)
    z = (f.mean(("chain", "draw")) - idata.predictions["mean"]) / idata.predictions["sd"]
    assert float(abs(z).max()) < 5 / np.sqrt(400)  # the draws' means are the predictive means
    assert list(idata.predictions["client"].values) == ["north", "south"]
    assert idata.constant_data["queried"].shape == (2, K_ROUNDS)
    assert idata.constant_data["y_test"].shape == (25,)
    assert np.all(idata.predictions["sd"].values > 0)


def test_zero_columns_change_nothing(problem):
    """Parties with views of different widths pad with zero columns: the SE-ARD kernel, the
    fit and hence every number are unchanged."""
    pad = [np.hstack([a, np.zeros((len(a), 1))]) for a in problem["pool"]]
    data = [(np.hstack([X, np.zeros((len(X), 1))]), y) for X, y in problem["clients"].data]
    method = fedppl.CoTraining("hybrid", "marginal", fit_steps=30)
    plain = method.run(jax.random.key(0), problem["clients"], 1, pool=problem["pool"],
                       progress_bar=False)
    padded = method.run(jax.random.key(0), fedppl.Clients.from_list(data), 1, pool=pad,
                        progress_bar=False)
    assert plain.queried(0) == padded.queried(0)
    np.testing.assert_allclose(plain.predict(0, problem["pool"][0])[0],
                               padded.predict(0, pad[0])[0], rtol=1e-9, atol=1e-12)
    assert "rmse" not in plain.history and "epsilon" not in plain.history


def _bad_calls():
    """(id, constructor keywords, run overrides, error, message)."""
    dp = ct.DPSettings(1.0, 0.01)
    return [
        ("combination", {"combination": "average"}, {}, ValueError, "combination must be one of"),
        ("uncertainty", {"uncertainty": "diag"}, {}, ValueError, "uncertainty must be one of"),
        ("dp-not-settings", {"dp": {"epsilon": 1.0}}, {}, TypeError, "dp must be"),
        ("epsilon-zero", {"dp": dp._replace(epsilon=0.0)}, {}, ValueError, "dp.epsilon"),
        ("epsilon-nan", {"dp": dp._replace(epsilon=float("nan"))}, {}, ValueError, "dp.epsilon"),
        ("epsilon-string", {"dp": dp._replace(epsilon="1")}, {}, TypeError, "dp.epsilon"),
        ("delta-above-1", {"dp": dp._replace(delta=1.5)}, {}, ValueError, "dp.delta"),
        ("delta-zero", {"dp": dp._replace(delta=0.0)}, {}, ValueError, "dp.delta"),
        ("delta-none", {"dp": dp._replace(delta=None)}, {}, TypeError, "dp.delta"),
        ("d-negative", {"dp": dp._replace(d=-1.0)}, {}, ValueError, "dp.d"),
        ("rule", {"dp": dp._replace(rule="dwork")}, {}, ValueError, "dp.rule"),
        ("sensitivity", {"dp": dp._replace(sensitivity="l2")}, {}, ValueError, "dp.sensitivity"),
        ("inflate-variance", {"dp": dp._replace(inflate_variance="yes")}, {}, TypeError,
         "inflate_variance"),
        ("optimizer-string", {"optimizer": "adam"}, {}, TypeError, "optimizer must be an optax"),
        ("optimizer-rate", {"optimizer": 0.05}, {}, TypeError, "optimizer must be an optax"),
        ("fit-steps-zero", {"fit_steps": 0}, {}, ValueError, "fit_steps"),
        ("fit-steps-float", {"fit_steps": 2.5}, {}, TypeError, "fit_steps"),
        ("rounds-zero", {}, {"num_rounds": 0}, ValueError, "num_rounds"),
        ("rounds-negative", {}, {"num_rounds": -2}, ValueError, "num_rounds"),
        ("rounds-float", {}, {"num_rounds": 2.5}, TypeError, "num_rounds"),
        ("rounds-string", {}, {"num_rounds": "3"}, TypeError, "num_rounds"),
        ("rounds-beyond-pool", {}, {"num_rounds": 13}, ValueError, "distinct pool points"),
        ("integer-seed", {}, {"rng_key": 0}, TypeError, "rng_key must be a JAX key"),
        ("clients-not-clients", {}, {"clients": "list"}, TypeError, "fedppl.Clients"),
        ("one-party", {}, {"clients": "one"}, ValueError, "at least two parties"),
        ("three-arrays", {}, {"clients": "three"}, ValueError, r"holds \(X, y\)"),
        ("string-labels", {}, {"clients": "strings"}, TypeError, "must be numbers"),
        ("boolean-labels", {}, {"clients": "bools"}, TypeError, "south's y must hold real"),
        ("vector-X", {}, {"clients": "vector"}, ValueError, r"\(rows, columns\) matrix"),
        ("nan-labels", {}, {"clients": "nan"}, ValueError, "NaN"),
        ("pool-sizes", {}, {"pool": "short"}, ValueError,
         "south's pool has 9 points but north's has 12"),
        ("pool-nan", {}, {"pool": "nan"}, ValueError, "north's pool has NaN"),
        ("pool-columns", {}, {"pool": "wide"}, ValueError, "2 columns but the party's X has 1"),
        ("pool-count", {}, {"pool": "one"}, ValueError, "pool has 1 arrays for 2 parties"),
        ("pool-array", {}, {"pool": "array"}, TypeError, "one array per party"),
        ("pool-empty", {}, {"pool": "empty"}, ValueError, "non-empty"),
        ("test-without-targets", {}, {"y_test": None}, ValueError, "give both"),
        ("test-rows", {}, {"y_test": "short"}, ValueError, "25 test inputs for 5 test targets"),
        ("y-test-inf", {}, {"y_test": "inf"}, ValueError, "y_test has NaN or infinite"),
    ]


def _apply(problem, change):
    """The run's keyword arguments with ``change`` applied (built lazily: fedppl.Clients
    refuses some variants itself)."""
    clients, pool = problem["clients"], list(problem["pool"])
    kw = {"rng_key": jax.random.key(0), "clients": clients, "num_rounds": 2, "pool": pool,
          "test": problem["test"], "y_test": problem["y_test"]}
    (X0, y0), (X1, y1) = clients.data
    names = ["north", "south"]

    def make(data):
        return fedppl.Clients.from_list(data, names[:len(data)])

    variants = {
        ("clients", "list"): lambda: [(X0, y0), (X1, y1)],
        ("clients", "one"): lambda: make([(X0, y0)]),
        ("clients", "three"): lambda: make([(X0, y0, y0), (X1, y1, y1)]),
        ("clients", "strings"): lambda: make([(X0, y0), (X1, y1.astype(str))]),
        ("clients", "bools"): lambda: make([(X0, y0), (X1, y1 > 0)]),
        ("clients", "vector"): lambda: make([(X0[:, 0], y0), (X1[:, 0], y1)]),
        ("clients", "nan"): lambda: make([(X0, y0), (X1, np.where(y1 > 0, np.nan, y1))]),
        ("pool", "short"): lambda: [pool[0], pool[1][:9]],
        ("pool", "nan"): lambda: [np.where(np.arange(12)[:, None] == 3, np.nan, pool[0]),
                                  pool[1]],
        ("pool", "wide"): lambda: [np.hstack([pool[0], pool[0]]), pool[1]],
        ("pool", "one"): lambda: pool[:1],
        ("pool", "array"): lambda: np.stack(pool),
        ("pool", "empty"): lambda: [pool[0][:0], pool[1][:0]],
        ("y_test", "short"): lambda: problem["y_test"][:5],
        ("y_test", "inf"): lambda: np.append(problem["y_test"][:-1], np.inf),
    }
    for key, value in change.items():
        build = variants.get((key, value))
        kw[key] = value if build is None else build()
    return kw


@pytest.mark.parametrize("ctor,change,error,match", [c[1:] for c in _bad_calls()],
                         ids=[c[0] for c in _bad_calls()])
def test_bad_input_is_refused_before_anything_runs(problem, monkeypatch, ctor, change, error,
                                                   match):
    def no_fit(*args, **kwargs):
        raise AssertionError("validation must come before the hyperparameter fit")

    monkeypatch.setattr(ct, "fit_hyperparameters", no_fit)
    with pytest.raises(error, match=match):  # some refused by fedppl.Clients when built
        kw = _apply(problem, change)
        fedppl.CoTraining(**{"fit_steps": 10, **ctor}).run(progress_bar=False, **kw)


def test_update_needs_init_and_a_fresh_pool_point(problem):
    method = fedppl.CoTraining(fit_steps=10, optimizer=optax.adam(0.05))
    with pytest.raises(RuntimeError, match="before update"):
        method.update(None)
    state = method.init(jax.random.key(0), problem["clients"], pool=[p[:1] for p in
                                                                      problem["pool"]])
    state, _ = method.update(state)
    with pytest.raises(ValueError, match="queried all 1 pool points"):
        method.update(state)
