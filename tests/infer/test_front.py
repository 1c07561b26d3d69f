"""Every method runs through the same calls: ``init``, ``update``, ``run``, the shared history
keys, ``.to_arviz()`` and JSON with the same key names."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedppl
from fedppl.infer.base import COMMON_HISTORY, Result, RunState


def _pvi(global_vi: bool = False):
    from fedppl.models import logistic_regression as model

    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 2))
    y = (rng.uniform(size=120) < 1 / (1 + np.exp(-X @ np.array([1.5, -1.0])))) * 1.0
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    settings = dict(num_particles=16, elbo_samples=8)
    if global_vi:
        return fedppl.GlobalVI(model, fedppl.PVIGuide(model), num_steps=20, **settings), \
            clients, {}, "elbo"
    return fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", local_steps=20,
                      **settings), clients, {}, "elbo"


def _fedbnr():
    from fedppl.models.random_features import URKSpec

    X = np.linspace(-3, 3, 60)[:, None]
    clients = fedppl.partition.homogeneous(X, np.sin(X[:, 0]), num_clients=2, seed=0)
    spec = URKSpec(input_dim=1, feature_widths=(), shift_widths=(), num_samples=10)
    return fedppl.FedBNR(spec, kernel="avg", local_steps=3, eval_every=1), clients, \
        {"validation": (X[::7], np.sin(X[::7, 0]))}, "elbo"


def _pfedmul():
    from fedppl.models import mogp

    rng = np.random.default_rng(0)
    spec = mogp.MOGPSpec(("regression", "classification"), num_latent=1)

    def one(n):
        x = rng.uniform(0, 5, (n, 1))
        return [x, x], [np.sin(x[:, 0]), (np.sin(x[:, 0]) > 0).astype(float)]

    clients = mogp.multitask_clients([one(10), one(12)], spec)
    method = fedppl.PFedMul(spec, mogp.init_hyper(spec, 1, W=jnp.ones((2, 1))), num_inducing=5)
    return method, clients, {}, "elbo"


def _cotraining():
    rng = np.random.default_rng(0)

    def views(n):
        y = rng.normal(size=n)
        return [(0.9 * y + 0.4 * rng.normal(size=n))[:, None] for _ in range(2)], y

    (X1, _), y1 = views(15)
    (_, X2), y2 = views(15)
    pool, _ = views(20)
    test, y_test = views(20)
    clients = fedppl.Clients.from_list([(X1, y1), (X2, y2)], names=["party 0", "party 1"])
    return fedppl.CoTraining("noisy", "full", fit_steps=20), clients, \
        {"pool": pool, "test": test, "y_test": y_test}, None


def _sgp():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (60, 1))
    clients = fedppl.partition.homogeneous(X, np.sin(2 * X[:, 0]), num_clients=3, seed=0)
    return fedppl.FederatedSGP("dpo", num_inducing=5, local_steps=5), clients, {}, \
        "free_energy"


def _fsgp():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (60, 1))
    clients = fedppl.partition.homogeneous(X, np.sin(2 * X[:, 0]), num_clients=3, seed=0)
    return fedppl.FSGP(num_inducing=5, local_steps=5), clients, {}, "bound"


METHODS = {"PVI": _pvi, "GlobalVI": lambda: _pvi(True), "FedBNR": _fedbnr,
           "PFedMul": _pfedmul, "CoTraining": _cotraining, "FederatedSGP": _sgp, "FSGP": _fsgp}


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_has_the_same_front(name):
    method, clients, kwargs, objective = METHODS[name]()
    state = method.init(jax.random.key(0), clients, **kwargs)
    assert isinstance(state, RunState) and state.round == 0
    state, info = method.update(state)
    assert set(COMMON_HISTORY) <= set(info) and info["round"] == 1
    if objective is not None:
        assert objective in info

    result = method.run(jax.random.key(0), clients, 2, progress_bar=False, **kwargs)
    assert isinstance(result, Result)
    keys = set(result.history)
    assert set(COMMON_HISTORY) <= keys and (objective is None or objective in keys)
    assert result.history["round"].tolist()[0] == 1
    assert all(len(v) == len(result.history["round"]) for v in result.history.values())
    assert result.client_names == (("pooled",) if name == "GlobalVI" else clients.names)

    import xarray as xr

    assert isinstance(result.to_arviz(), xr.DataTree)  # what ArviZ 1.x takes
    out = json.loads(json.dumps(result.to_json()))
    assert set(out) == {"method", "summary", "history", "rejected"}
    assert set(out["history"]) == keys and out["summary"]["rounds"] == result.num_rounds


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("bad_key, bad_rounds", [(0, 2), (None, 2), ("KEY", 1)])
def test_every_method_refuses_a_seed_for_a_key(name, bad_key, bad_rounds):
    method, clients, kwargs, _ = METHODS[name]()
    with pytest.raises(TypeError, match="rng_key"):
        method.run(bad_key, clients, bad_rounds, progress_bar=False, **kwargs)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("rounds, error", [(0, ValueError), (-2, ValueError), (2.5, TypeError),
                                            ("3", TypeError)])
def test_every_method_refuses_bad_round_counts(name, rounds, error):
    method, clients, kwargs, _ = METHODS[name]()
    with pytest.raises(error, match="num_rounds"):
        method.run(jax.random.key(0), clients, rounds, progress_bar=False, **kwargs)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_wants_clients(name):
    method, clients, kwargs, _ = METHODS[name]()
    with pytest.raises(TypeError, match="Clients"):
        method.run(jax.random.key(0), list(clients.data), 1, progress_bar=False, **kwargs)
