"""FederatedSGP: exactness against the exact GP, federated runs through the one front, bad input."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedppl import partition
from fedppl.clients import Clients
from fedppl.infer.base import COMMON_HISTORY
from fedppl.infer.sparse_gps import DPO_DEFAULTS, PAPER_DPO, FederatedSGP, SGPConfig
from fedppl.models import gp

HYP = {"lengthscale": 0.6, "variance": 1.3, "noise": 0.2}


def _data(N=24, seed=0):
    rng = np.random.default_rng(seed)
    X = np.sort(rng.uniform(-2, 2, (N, 1)), 0)
    return X, np.sin(2 * X[:, 0]) + HYP["noise"] * rng.normal(size=N)


@pytest.mark.parametrize("covariance, s_raw", [("diag", 2 * np.log(HYP["noise"])),
                                               ("noise", 0.0)])
def test_dpo_closed_form_factor_recovers_exact_gp(covariance, s_raw):
    X, y = _data()
    sgp = FederatedSGP("dpo", pseudo_fraction=1.0, fixed_hyper=HYP, fixed_inducing=X,
                       local_steps=1, covariance=covariance)
    res = sgp.run(jax.random.key(0), Clients.from_list([(X, y)]), 1, progress_bar=False)
    # the optimal DPO factor of a Gaussian likelihood: V = X, m = y, S = noise^2 I (diagonal
    # S = diag(exp(s)): s = 2 log noise; relative to the noise, S = noise^2 diag(exp(s)): s = 0)
    pseudo = res.state.pseudo._replace(V=jnp.asarray(X)[None], m=jnp.asarray(y)[None],
                                       s_raw=jnp.full((1, len(X)), s_raw))
    # K_ZZ at 24 close 1-D inputs is ill-conditioned: the default jitter (1e-6) shifts the model
    # by ~1e-3 when extrapolating; with a float64-sized jitter the sparse GP is the exact GP
    res = dataclasses.replace(res, state=res.state._replace(pseudo=pseudo),
                              spec=res.spec._replace(jitter=1e-11))
    Xs = np.linspace(-2.5, 2.5, 17)[:, None]
    params = gp.init_params(1, HYP["lengthscale"], HYP["variance"], HYP["noise"])
    mean, var = gp.predict(params, X, y, Xs)
    got_mean, got_var = res.predict(Xs, num_samples=3)
    np.testing.assert_allclose(got_mean, mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_var, var + HYP["noise"] ** 2, rtol=1e-4)
    # the predictive log-likelihood uses the same moments
    ll = res.log_likelihood(Xs, np.sin(2 * Xs[:, 0]), num_samples=3)
    ref = np.mean(-0.5 * np.log(2 * np.pi * (var + 0.04))
                  - 0.5 * (np.sin(2 * Xs[:, 0]) - mean) ** 2 / (var + 0.04))
    assert ll == pytest.approx(float(ref), rel=1e-4)
    mu, sd = res.inducing()
    np.testing.assert_array_equal(mu, X)
    np.testing.assert_array_equal(sd, 0.0)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(1)
    X = rng.uniform(-3, 3, (90, 1))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=90)
    Xt = np.linspace(-3, 3, 40)[:, None]
    return partition.homogeneous(X, y, 3, seed=0), Xt, np.sin(2 * Xt[:, 0])


@pytest.fixture(scope="module")
def runs(problem):
    clients = problem[0]
    fronts = {m: FederatedSGP(m, num_inducing=8, local_steps=100) for m in ("dpo", "fixed", "cpo")}
    results = {m: f.run(jax.random.key(0), clients, 9, progress_bar=False)
               for m, f in fronts.items()}
    sync = FederatedSGP("dpo", SGPConfig(num_inducing=8, local_steps=100),
                        schedule="synchronous", damping=0.3, optimizer=optax.adam(1e-2))
    results["sync"] = sync.run(jax.random.key(0), clients, 2, progress_bar=False)
    return fronts, results


def test_federated_dpo_beats_fixed_and_cpo(problem, runs):
    _, Xt, yt = problem
    results = runs[1]
    lls = {m: results[m].log_likelihood(Xt, yt, num_samples=20) for m in ("dpo", "fixed", "cpo")}
    for m in lls:
        assert np.all(np.isfinite(results[m].history["free_energy"]))
    assert lls["dpo"] > lls["fixed"] + 0.2 and lls["dpo"] > lls["cpo"] + 0.2, lls
    # synchronous (vmapped over clients, damped): runs, stays finite and improves
    fe = results["sync"].history["free_energy"]
    assert np.all(np.isfinite(fe)) and fe[-1] > fe[0]


def test_sequential_rounds_cycle_through_clients_and_history_has_the_common_keys(runs):
    res = runs[1]["dpo"]
    h = res.history
    assert set(COMMON_HISTORY) | {"free_energy", "local_free_energy"} <= set(h)
    assert h["round"].tolist() == list(range(1, 10))
    assert h["communications"].tolist() == list(range(1, 10)) and h["passes"][-1] == 3.0
    assert h["messages_up"].tolist() == [1] * 9 and np.all(h["bytes_up"] > 0)
    took_part = np.isfinite(h["local_free_energy"])
    np.testing.assert_array_equal(took_part, np.eye(3, dtype=bool)[np.arange(9) % 3])
    sync = runs[1]["sync"].history
    assert sync["communications"].tolist() == [3, 6] and sync["messages_up"].tolist() == [3, 3]
    assert np.isfinite(sync["local_free_energy"]).all()


def test_init_and_update_reproduce_run(problem, runs):
    fronts, results = runs
    state = fronts["fixed"].init(jax.random.key(0), problem[0])
    for _ in range(2):
        state, info = fronts["fixed"].update(state)
    assert info["round"] == 2 and info["messages_up"] == 1
    assert info["free_energy"] == pytest.approx(results["fixed"].history["free_energy"][1],
                                                rel=1e-12)


def test_summary_json_and_arviz(runs, tmp_path):
    res = runs[1]["dpo"]
    out = res.to_json(str(tmp_path / "dpo.json"))
    assert json.loads((tmp_path / "dpo.json").read_text())["summary"] == out["summary"]
    assert out["method"] == "SGP" and out["summary"]["rounds_to_convergence"] >= 1
    assert out["summary"]["method"] == "dpo" and out["summary"]["rounds"] == 9
    idata = res.to_arviz(jax.random.key(2), num_samples=48)
    post = idata.posterior
    assert set(post.data_vars) == {"lengthscale", "variance", "noise", "Z", "u"}
    assert post["Z"].shape == (4, 12, 8, 1) and post["u"].shape == (4, 12, 8)  # 4 chains
    assert np.all(post["noise"].values > 0)
    fixed = runs[1]["fixed"].to_arviz(num_samples=16)
    assert "Z" in fixed.constant_data and "Z" not in fixed.posterior


X12, Y12 = _data(12)
TWO = partition.homogeneous(X12, Y12, 2, seed=0)
BAD_SETTINGS = [
    ({"method": "pvi"}, ValueError, "method"),
    ({"num_inducing": 0}, ValueError, "num_inducing"),
    ({"num_inducing": 2.5}, TypeError, "num_inducing"),
    ({"pseudo_fraction": 1.5}, ValueError, "pseudo_fraction"),
    ({"pseudo_fraction": 0.0}, ValueError, "pseudo_fraction"),
    ({"max_pseudo": 0}, ValueError, "max_pseudo"),
    ({"damping": 0.0}, ValueError, "damping"),
    ({"damping": 1.5}, ValueError, "damping"),
    ({"alpha": -0.1}, ValueError, "alpha"),
    ({"alpha": float("nan")}, ValueError, "alpha"),
    ({"local_steps": 0}, ValueError, "local_steps"),
    ({"local_steps": "10"}, TypeError, "local_steps"),
    ({"num_samples": 0}, ValueError, "num_samples"),
    ({"inner_steps": -1}, ValueError, "inner_steps"),
    ({"init_precision": 0.0}, ValueError, "init_precision"),
    ({"inducing_precision": -1.0}, ValueError, "inducing_precision"),
    ({"learn_inducing_sd": "no"}, ValueError, "learn_inducing_sd"),
    ({"optimizer": "adam"}, TypeError, "optimizer"),
    ({"optimizer": 0.01}, TypeError, "optimizer"),
    ({"schedule": "async"}, ValueError, "schedule"),
    ({"covariance": "dense"}, ValueError, "covariance"),
    ({"likelihood": "poisson"}, ValueError, "likelihood"),
    ({"pseudo_init": "kmeans"}, ValueError, "pseudo_init"),
    ({"init_inducing": "kmeans"}, ValueError, "init_inducing"),
    ({"init_inducing": "pseudo-inputs", "pseudo_init": "prior"}, ValueError, "pseudo_init='data'"),
    ({"learning_rate": 0.1}, TypeError, "unknown settings.*learning_rate"),
    ({"fixed_hyper": {"lengthscale": 1.0, "variance": 1.0}}, ValueError, "fixed_hyper"),
    ({"fixed_hyper": {**HYP, "lengthscale": -1.0}}, ValueError, "fixed_hyper"),
    ({"fixed_inducing": np.array([[0.0], [np.nan]])}, ValueError, "fixed_inducing"),
    ({"fixed_inducing": np.zeros(3)}, ValueError, "fixed_inducing"),
    ({"config": {"num_inducing": 3}}, TypeError, "SGPConfig"),
]


@pytest.mark.parametrize("settings, error, match", BAD_SETTINGS,
                         ids=[next(iter(s)) + "-" + str(i) for i, (s, _, _) in
                              enumerate(BAD_SETTINGS)])
def test_bad_settings_raise_before_anything_runs(settings, error, match):
    settings = dict(settings)
    method = settings.pop("method", "dpo")
    with pytest.raises(error, match=match):
        FederatedSGP(method, **settings)


def _clients(X, y):
    return Clients.from_list([(X[:6], y[:6]), (X[6:], y[6:])])


BAD_RUNS = [
    ({"num_rounds": -2}, ValueError, "num_rounds"),
    ({"num_rounds": 0}, ValueError, "num_rounds"),
    ({"num_rounds": 2.5}, TypeError, "num_rounds"),
    ({"num_rounds": "3"}, TypeError, "num_rounds"),
    ({"rng_key": None}, TypeError, "rng_key"),
    ({"rng_key": 0}, TypeError, "rng_key"),
    ({"clients": (X12, Y12)}, TypeError, "clients must be a fedppl.Clients"),
    ({"settings": {"num_inducing": 50}}, ValueError, "exceeds the total number"),
    ({"settings": {"fixed_inducing": np.arange(13.0)[:, None]}}, ValueError, "exceeds the total"),
    ({"settings": {"fixed_inducing": np.arange(6.0).reshape(3, 2)}}, ValueError, r"shape \(M, 1\)"),
    ({"settings": {"fixed_hyper": {**HYP, "lengthscale": [1.0, 2.0]}}}, ValueError,
     "lengthscale"),
    ({"settings": {"likelihood": "bernoulli"}}, ValueError, "client 0.*Bernoulli"),
    ({"clients": _clients(X12, np.where(np.arange(12) < 6, 0.0, 2.0))}, ValueError,
     "client 1.*Bernoulli.*2.0", {"likelihood": "bernoulli"}),
    ({"clients": _clients(X12[:, 0], Y12)}, ValueError, r"client 0.*shape \(N, D\)"),
    ({"clients": _clients(X12, Y12[:, None])}, ValueError, r"client 0.*y of shape \(N,\)"),
    ({"clients": Clients.from_list([(X12, Y12, Y12)])}, ValueError, "got 3 arrays"),
    ({"clients": _clients(np.zeros((12, 0)), Y12)}, ValueError, "no features"),
]


@pytest.mark.parametrize("case", BAD_RUNS, ids=[str(i) for i in range(len(BAD_RUNS))])
def test_bad_runs_raise_before_anything_runs(case):
    args, error, match = case[:3]
    settings = {"num_inducing": 4, **(case[3] if len(case) > 3 else {}),
                **args.get("settings", {})}
    front = FederatedSGP("dpo", **settings)
    with pytest.raises(error, match=match):
        front.run(args.get("rng_key", jax.random.key(0)), args.get("clients", TWO),
                  args.get("num_rounds", 1), progress_bar=False)


def test_nan_data_is_refused_naming_the_client():
    bad = [(X12[:6], Y12[:6]), (X12[6:], np.where(np.arange(6) == 2, np.nan, Y12[6:]))]
    with pytest.raises(ValueError, match="client 1"):
        Clients.from_list(bad)


def test_duplicate_inducing_inputs_warn():
    Z = np.concatenate([X12[:3], X12[:3]])
    with pytest.warns(UserWarning, match="duplicate"):
        FederatedSGP("fixed", fixed_inducing=Z, fixed_hyper=HYP)


def test_result_checks_test_inputs(runs):
    res = runs[1]["dpo"]
    with pytest.raises(ValueError, match=r"X must have shape \(n, 1\)"):
        res.predict(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="X contains NaN"):
        res.predict(np.array([[np.nan]]))
    with pytest.raises(ValueError, match=r"y must have shape \(2,\)"):
        res.log_likelihood(np.zeros((2, 1)), np.zeros(3))
    with pytest.raises(ValueError, match="y_std"):
        res.rmse(np.zeros((2, 1)), np.zeros(2), y_std=-1.0)
    with pytest.raises(ValueError, match="Gaussian likelihood"):
        dataclasses.replace(res, spec=res.spec._replace(likelihood="bernoulli")).log_likelihood(
            np.zeros((2, 1)), np.zeros(2))


def test_dpo_defaults_and_the_papers_settings():
    """``FederatedSGP("dpo")`` with no settings gets :data:`DPO_DEFAULTS` (q(Z) held narrow, the
    pseudo-noise relative to the noise); ``**PAPER_DPO`` gives the paper's DPO back; the other
    methods keep the paper's settings, a Bernoulli DPO a diagonal S_k (it has no noise), and a
    setting given is kept."""
    def spec(method, **kw):
        return FederatedSGP(method, **kw)._spec(1)

    s = spec("dpo")
    assert (s.alpha, s.covariance, s.learn_z_sd) == (DPO_DEFAULTS["alpha"], "noise", False)
    assert FederatedSGP("dpo").config.inducing_precision == DPO_DEFAULTS["inducing_precision"]
    paper = spec("dpo", **PAPER_DPO)
    assert (paper.alpha, paper.covariance, paper.learn_z_sd) == (0.1, "diag", True)
    for method in ("cpo", "fedavg-z", "fixed"):
        s = spec(method)
        assert (s.alpha, s.covariance, s.learn_z_sd) == (0.1, "diag", True)
        assert FederatedSGP(method).config.inducing_precision is None
    assert spec("dpo", likelihood="bernoulli").covariance == "diag"
    assert spec("dpo", alpha=0.3, covariance="full").covariance == "full"
    assert spec("dpo", alpha=0.3).alpha == 0.3
