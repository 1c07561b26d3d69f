"""``check`` and ``refine`` of the Pyro port's results: the core's importance check and SMC
sampler, each client's log-likelihood at the server's draws evaluated by torch on the Pyro model.

* The same ``q`` and the same key give the same draws, so the check of a Pyro result and of the
  NumPyro result of the same model and data (the Pyro run's ``q`` on the NumPyro model's guide)
  agree to round-off: log-likelihoods, k-hat, ESS, corrected moments.
* With local sites (one logistic intercept per client), the clients' Laplace estimates of their
  marginal likelihoods and the sampler's particles are the NumPyro core's to round-off.
* ``refine`` from a damped, unfinished PVI answer reaches the exact posterior of Bayesian linear
  regression within its Monte Carlo error, by importance refinement and by the SMC sampler, as
  the NumPyro result does with the same key.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyro
import pyro.distributions as pd
import pytest
import torch

import fedppl
import fedppl.pyro as fp
from fedppl.algorithms import solvers
from fedppl.pyro.bridge import to_jax
from fedppl.pyro.result import jax_key
from tests.pyro import models
from tests.pyro.conftest import key

F64 = torch.float64
DRAWS = 400


def _fit(pair, rounds, damping=1.0, **guide_kw):
    """PVI on the Pyro model (synchronous, full rank), and the same answer as a NumPyro
    result: the NumPyro model's guide with the Pyro run's q and private guides."""
    py = fp.PVI(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64, **guide_kw),
                "synchronous", damping, elbo_samples=0).run(
        key(), pair.clients, rounds, progress_bar=False, **pair.kwargs)
    guide = fedppl.PVIGuide(pair.numpyro, family="fullrank", **guide_kw)
    guide.setup(*pair.clients.client(0), **pair.kwargs)
    arrays = {k: to_jax(getattr(py, k)) for k in ("q", "factors", "local")}
    np_ = fedppl.PVIResult(guide=guide, history=py.history, client_names=py.client_names,
                           model=solvers.bind(pair.numpyro, pair.kwargs), **arrays)
    return py, np_


# -- the check, global sites only ----------------------------------------------------------------


@pytest.fixture(scope="module")
def logistic():
    pair = models.logistic()
    py, np_ = _fit(pair, 4)
    return pair, py, np_


def test_check_of_a_pyro_result_is_the_numpyro_check(logistic):
    pair, py, np_ = logistic
    ours = py.check(key(1), pair.clients, DRAWS)
    theirs = np_.check(jax_key(key(1)), pair.clients, DRAWS)
    assert isinstance(ours, fp.result.ImportanceResult)
    np.testing.assert_array_equal(ours.draws, theirs.draws)
    np.testing.assert_allclose(ours.log_lik, theirs.log_lik, rtol=1e-12, atol=1e-10)
    assert abs(ours.khat - theirs.khat) < 1e-8 and abs(ours.ess - theirs.ess) < 1e-6
    for a, b in zip(ours.mean_and_cov(), theirs.mean_and_cov(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    draws = ours.sample(key(2), 50)
    assert set(draws) == {"w", "b"} and isinstance(draws["w"], torch.Tensor)
    assert draws["w"].shape == (50, 3)


def test_the_check_refuses_a_subsampling_pyro_model(logistic):
    pair, py, _ = logistic

    def minibatch(X, y=None):
        w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        b = pyro.sample("b", pd.Normal(0.0, 2.0))
        with pyro.plate("data", X.shape[0], subsample_size=5) as idx:
            pyro.sample("y", pd.Bernoulli(logits=X[idx] @ w + b), obs=y[idx])

    guide = fp.PVIGuide(minibatch, family="fullrank", dtype=F64)
    guide.setup(*pair.clients.client(0))
    result = dataclasses.replace(py, guide=guide, model=minibatch)
    with pytest.raises(ValueError, match=r"subsamples plate 'data' \(5 of"):
        result.check(key(1), pair.clients, DRAWS)


# -- local sites: the clients' marginal likelihoods and the sampler --------------------------------


@pytest.fixture(scope="module")
def intercepts():
    pair = models.intercepts()
    py, np_ = _fit(pair, 1, global_sites=["mu", "w"])
    return pair, py, np_


def test_check_with_local_sites_is_the_numpyro_check(intercepts):
    pair, py, np_ = intercepts
    kw = {"local_draws": 4, "warn": False}
    ours = py.check(key(1), pair.clients, 100, **kw)
    theirs = np_.check(jax_key(key(1)), pair.clients, 100, **kw)
    np.testing.assert_allclose(ours.log_lik, theirs.log_lik, rtol=1e-9, atol=1e-8)
    assert abs(ours.khat - theirs.khat) < 1e-6 and abs(ours.local_sd - theirs.local_sd) < 1e-8


def test_refine_with_local_sites_is_the_numpyro_sampler(intercepts):
    pair, py, np_ = intercepts
    kw = {"num_particles": 100, "islands": 2, "local_draws": 4, "num_rounds": 1,
          "progress_bar": False, "warn": False}
    ours = py.refine(key(1), pair.clients, **kw)
    theirs = np_.refine(jax_key(key(1)), pair.clients, **kw)
    assert isinstance(ours, fp.result.SMCResult) and "local sites" in ours.chosen
    np.testing.assert_allclose(ours.particles, theirs.particles, rtol=1e-8, atol=1e-8)
    assert ours.sample(key(2), 10)["w"].shape == (10, 2)


# -- refine: the exact posterior of Bayesian linear regression ---------------------------------


@pytest.fixture(scope="module")
def linear():
    pair = models.linear()
    py, np_ = _fit(pair, 2, damping=0.3)  # unfinished: half of each client's factor
    return pair, py, np_


@pytest.mark.parametrize("method", ["importance", "smc"])
def test_refine_reaches_the_exact_posterior_as_the_numpyro_result_does(linear, method):
    pair, py, np_ = linear
    exact_mean, exact_cov = models.exact_linear_posterior(*pair.arrays)
    sd = np.sqrt(np.diag(exact_cov))
    start = np.sqrt(np.diag(py.mean_and_cov()[1].numpy()))
    assert np.all(start / sd > 1.3)  # the start is too wide
    kw = ({"num_draws": DRAWS} if method == "importance" else
          {"num_particles": 200, "islands": 4})
    ours = py.refine(key(1), pair.clients, method=method, progress_bar=False, **kw)
    theirs = np_.refine(jax_key(key(1)), pair.clients, method=method, progress_bar=False, **kw)
    mean, cov = ours.mean_and_cov()
    mc = ours.mcse() if method == "importance" else ours.mcse()["mean"]
    assert np.all(np.abs(mean - exact_mean) < 4 * mc + 0.02 * sd), (mean - exact_mean) / sd
    np.testing.assert_allclose(np.sqrt(np.diag(cov)) / sd, 1.0, atol=0.15)
    np.testing.assert_allclose(mean, theirs.mean_and_cov()[0], rtol=1e-6, atol=1e-6 * sd.min())
