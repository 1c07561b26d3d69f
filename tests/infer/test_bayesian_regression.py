from __future__ import annotations

import jax
import numpy as np
import pytest

import fedppl
from fedppl.algorithms import exact
from fedppl.infer.bayesian_regression import FedBNR
from fedppl.models.random_features import URKSpec

SPEC = URKSpec(1, feature_widths=(), shift_widths=(), num_samples=40)


@pytest.fixture(scope="module")
def two_ranges():
    """The paper's synthetic setting: one function, two clients on disjoint halves of [-5, 5]."""
    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(-5, 5, 200))[:, None]
    f = lambda x: np.sin(x[:, 0]) + 0.3 * x[:, 0]  # noqa: E731
    y = f(x) + 0.3 * rng.normal(size=200)
    clients = fedppl.Clients.from_list([(x[:100], y[:100]), (x[100:150], y[100:150])])
    xv = rng.uniform(-5, 5, (60, 1))
    return clients, (xv, f(xv)), f


def _rmse(fit, val):
    mean, _ = fit.predict(val[0])
    return float(np.mean(np.sqrt(np.mean((np.asarray(mean) - val[1]) ** 2, axis=1))))


@pytest.fixture(scope="module")
def fits(two_ranges):
    clients, val, _ = two_ranges
    out = {}
    for kernel in ["avg", "local"]:
        model = FedBNR(SPEC, kernel=kernel, rounds=10, local_steps=20, eval_every=5)
        params, omega, _ = model.learn_kernel(jax.random.key(0), clients, val)
        for last in ["global", "local"]:
            out[kernel, last] = model.last_layer_fit(params, omega, clients, last)
    return out


def test_global_model_beats_local_ones_across_the_range(fits, two_ranges):
    _, val, _ = two_ranges
    assert fits["avg", "global"].num_models == 1
    assert fits["avg", "local"].num_models == fits["local", "local"].num_models == 2
    fed = _rmse(fits["avg", "global"], val)
    assert fed < 0.5 * _rmse(fits["avg", "local"], val)
    assert fed < 0.5 * _rmse(fits["local", "local"], val)


def test_phase_two_messages_have_fixed_sizes_and_no_raw_data(fits, two_ranges):
    clients, _, _ = two_ranges
    msgs = fits["avg", "global"].messages
    assert len(msgs) == clients.num_clients
    D = SPEC.num_features
    for k, msg in enumerate(msgs):
        assert type(msg) is exact.Stats and msg._fields == ("scatter", "proj", "count")
        assert np.shape(msg.scatter) == (D, D) and np.shape(msg.proj) == (D,)
        assert np.shape(msg.count) == ()  # the same for 100 points and for 50
        X_k, y_k = clients.client(k)
        sent = np.concatenate([np.ravel(np.asarray(m)) for m in msg])
        assert not np.isin(sent, X_k).any() and not np.isin(sent, y_k).any()
        assert float(msg.count) == len(y_k)


def test_kd_needs_server_data_and_names_are_checked(two_ranges):
    clients, val, _ = two_ranges
    with pytest.raises(ValueError, match="kd_data"):
        FedBNR(SPEC, kernel="kd").fit(jax.random.key(0), clients, val)
    with pytest.raises(ValueError, match="kernel must be one of"):
        FedBNR(SPEC, kernel="fedprox")
    with pytest.raises(ValueError, match="last_layer must be one of"):
        FedBNR(SPEC, last_layer="personal")


def test_kd_variant_runs_and_predicts(two_ranges):
    clients, val, f = two_ranges
    rng = np.random.default_rng(1)
    xk = rng.uniform(-5, 5, (30, 1))
    fit = FedBNR(SPEC, kernel="kd", rounds=4, local_steps=10, kd_steps=10, eval_every=2).fit(
        jax.random.key(0), clients, val, kd_data=(xk, f(xk)))
    mean, var = fit.predict(val[0])
    assert mean.shape == (1, 60) and np.all(np.asarray(var) > 0)
    assert fit.history["round"] == [2, 4]
