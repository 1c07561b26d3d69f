"""Front end: exactness against the exact GP, federated runs, bad input."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from fedppl import partition
from fedppl.clients import Clients
from fedppl.models import gp
from fedppl.infer.sparse_gps import SGPConfig, fit_sgp, rounds_to_convergence

HYP = {"lengthscale": 0.6, "variance": 1.3, "noise": 0.2}


def _data(N=24, seed=0):
    rng = np.random.default_rng(seed)
    X = np.sort(rng.uniform(-2, 2, (N, 1)), 0)
    return X, np.sin(2 * X[:, 0]) + HYP["noise"] * rng.normal(size=N)


def test_dpo_closed_form_factor_recovers_exact_gp():
    X, y = _data()
    cfg = SGPConfig(pseudo_fraction=1.0, fixed_hyper=HYP, fixed_inducing=X)
    res = fit_sgp("dpo", Clients.from_list([(X, y)]), 0, cfg)
    # the optimal DPO factor of a Gaussian likelihood: V = X, m = y, S = noise^2 I
    pseudo = res.state.pseudo._replace(V=jnp.asarray(X)[None], m=jnp.asarray(y)[None],
                                       s_raw=jnp.full((1, len(X)), 2 * np.log(HYP["noise"])))
    res.state = res.state._replace(pseudo=pseudo)
    # K_ZZ at 24 close 1-D inputs is ill-conditioned: the default jitter (1e-6) shifts the model
    # by ~1e-3 when extrapolating; with a float64-sized jitter the sparse GP is the exact GP
    res.spec = res.spec._replace(jitter=1e-11)
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
    np.testing.assert_array_equal(mu, X) and np.testing.assert_array_equal(sd, 0.0)


def test_federated_dpo_beats_fixed_and_cpo():
    rng = np.random.default_rng(1)
    X = rng.uniform(-3, 3, (90, 1))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=90)
    Xt = np.linspace(-3, 3, 40)[:, None]
    yt = np.sin(2 * Xt[:, 0])
    clients = partition.homogeneous(X, y, 3, seed=0)
    cfg = SGPConfig(num_inducing=8, local_steps=100)
    lls = {}
    for method in ("dpo", "fixed", "cpo"):
        res = fit_sgp(method, clients, 9, cfg)
        lls[method] = res.log_likelihood(Xt, yt, num_samples=20)
        assert np.all(np.isfinite(res.history["free_energy"]))
        assert res.history["passes"][-1] == 3.0 and res.history["communications"][-1] == 9
    assert lls["dpo"] > lls["fixed"] + 0.2 and lls["dpo"] > lls["cpo"] + 0.2, lls
    # synchronous (vmapped over clients, damped): runs, stays finite and improves
    res = fit_sgp("dpo", clients, 2, cfg._replace(schedule="synchronous", damping=0.3))
    fe = res.history["free_energy"]
    assert np.all(np.isfinite(fe)) and fe[-1] > fe[0]
    assert res.history["communications"][-1] == 6 and len(res.history["seconds"]) == 2


def test_bad_input():
    X, y = _data(12)
    clients = partition.homogeneous(X, y, 2)
    with pytest.raises(ValueError, match="exceeds the total number"):
        fit_sgp("dpo", clients, 1, SGPConfig(num_inducing=50))
    with pytest.raises(ValueError, match="pseudo_fraction"):
        fit_sgp("dpo", clients, 1, SGPConfig(num_inducing=4, pseudo_fraction=1.5))
    with pytest.raises(ValueError, match="method"):
        fit_sgp("pvi", clients, 1)
    bad = [(X[:6], y[:6]), (X[6:], np.where(np.arange(6) == 2, np.nan, y[6:]))]
    with pytest.raises(ValueError, match="client 1"):
        fit_sgp("dpo", Clients.from_list(bad), 1, SGPConfig(num_inducing=4))
    with pytest.raises(ValueError, match="client 0.*Bernoulli"):
        fit_sgp("dpo", clients, 1, SGPConfig(num_inducing=4, likelihood="bernoulli"))
    # duplicate inducing inputs: a warning, and the jitter keeps everything finite
    Z = np.concatenate([X[:3], X[:3]])
    with pytest.warns(UserWarning, match="duplicate"):
        res = fit_sgp("fixed", clients, 1, SGPConfig(fixed_inducing=Z, local_steps=5,
                                                      fixed_hyper=HYP))
    assert np.all(np.isfinite(np.asarray(res.predict(X, num_samples=2)[1])))


def test_rounds_to_convergence():
    hist = {"round": [1, 2, 3, 4, 5], "free_energy": [-10.0, -3.0, -1.2, -0.9, -1.0]}
    assert rounds_to_convergence(hist, 0.5) == 3
    assert rounds_to_convergence(hist, 0.15) == 4
    assert rounds_to_convergence(hist, 0.05) == 5
    assert rounds_to_convergence(hist, 100.0) == 1
