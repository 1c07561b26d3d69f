"""PVI in float32 (x64 off; see ``conftest.py``), through the public ``PVI(...).run`` front.

* Conjugate path (Bayesian linear regression): PVI's ``q`` is the exact posterior, to ``100 eps``
  times the condition number of the posterior precision, against a float64 posterior from the
  same float32 data.
* Non-conjugate path (logistic regression, natural-gradient local steps): PVI's fixed point is
  GlobalVI's. Both stop where their tolerances say, so the means may differ by
  ``sqrt(2 KL)`` standard deviations for the KL they stop at (``local_tol`` and the last round's
  ``kl_change``), plus the rounding of the fixed point itself, ``100 eps cond(Lambda)`` of
  ``|m| / sd``.

Both also check that everything stays float32, that the local solves converge (their residual
reaches the tolerance, or the dtype's rounding floor), and that no round warns.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import fedppl
from fedppl.guides import PVIGuide
from tests.conftest import linear_model, logistic_model
from tests.float32.conftest import assert_dtype, cond, rtol

pytestmark = pytest.mark.usefixtures("no_x64")


def _run(make, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a rejected/repaired/unconverged round
        return make().run(*args, **kwargs)


def exact_posterior(X, y, noise=0.5):
    """Float64 posterior of ``linear_model`` from the (float32) data as given."""
    X, y = np.asarray(X, np.float64), np.asarray(y, np.float64)
    prec = np.eye(X.shape[1]) + X.T @ X / noise**2
    cov = np.linalg.inv(prec)
    return cov @ X.T @ y / noise**2, cov, prec


@pytest.fixture
def linear32(no_x64):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3)) * np.array([1.0, 3.0, 0.3])  # posterior cond ~ 100
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=120)
    return X.astype(np.float32), y.astype(np.float32)


@pytest.fixture
def logistic32(no_x64):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(400, 3))
    logits = X @ np.array([1.5, -1.0, 0.5]) + 0.3
    y = (rng.uniform(size=400) < 1 / (1 + np.exp(-logits))).astype(float)
    return X.astype(np.float32), y.astype(np.float32)


@pytest.mark.parametrize("family", ["fullrank", "meanfield"])
def test_conjugate_pvi_is_the_exact_posterior(linear32, family):
    X, y = linear32
    clients = fedppl.partition.homogeneous(X, y, 4, seed=0)
    rounds = 2 if family == "fullrank" else 30  # mean-field: a fixed-point iteration
    res = _run(lambda: fedppl.PVI(linear_model, PVIGuide(linear_model, family=family),
                                  "synchronous", elbo_samples=0),
               jax.random.key(0), clients, rounds, progress_bar=False, tol=1e-12)
    assert_dtype((res.q, res.factors), what="result")
    mean, cov = res.mean_and_cov()
    want_m, want_c, prec = exact_posterior(X, y)
    t = rtol(cond=cond(prec))
    sd = np.sqrt(np.diag(want_c))
    assert np.all(res.history["kl_change"] >= 0)  # a KL, even in float32
    if family == "fullrank":
        np.testing.assert_allclose(cov, want_c, rtol=t, atol=t * np.abs(want_c).max())
    else:  # the mean-field optimum of a Gaussian: the exact mean, inverse diagonal precision
        np.testing.assert_allclose(cov, 1 / np.diag(prec), rtol=t)
    err = np.abs(np.asarray(mean, np.float64) - want_m)
    # rounding, and for the mean-field fixed-point iteration, which stopped once a round moved q
    # by kl_change, up to sqrt(2 kl_change) sds still to go
    to_go = np.sqrt(2 * float(res.history["kl_change"][-1])) if family == "meanfield" else 0.0
    assert np.all(err <= t * np.abs(want_m) + to_go * sd), (err, t * np.abs(want_m), to_go * sd)
    assert np.all(res.history["converged"] == 1)


def test_natural_gradient_pvi_reaches_global_vi(logistic32):
    X, y = logistic32
    clients = fedppl.partition.homogeneous(X, y, 4, seed=0)
    local_tol = 1e-10
    ref = _run(lambda: fedppl.GlobalVI(logistic_model, PVIGuide(logistic_model, family="fullrank"),
                                       num_particles=16, elbo_samples=0, tol=local_tol),
               jax.random.key(0), clients)
    res = _run(lambda: fedppl.PVI(logistic_model, PVIGuide(logistic_model, family="fullrank"),
                                  "synchronous", num_particles=16, local_tol=local_tol,
                                  elbo_samples=0),
               jax.random.key(0), clients, 12, progress_bar=False, tol=1e-11)
    assert_dtype((ref.q, res.q, res.factors), what="result")
    assert np.all(ref.history["converged"] == 1) and np.all(res.history["converged"] == 1)
    assert np.all(res.history["kl_change"] >= 0)
    m, c = res.mean_and_cov()
    rm, rc = ref.mean_and_cov()
    rm, rc = np.asarray(rm, np.float64), np.asarray(rc, np.float64)
    sd = np.sqrt(np.diag(rc))
    stop = max(local_tol, float(res.history["kl_change"][-1]))
    bound = 10 * np.sqrt(2 * stop) + rtol(cond=cond(rc)) * (1 + np.abs(rm) / sd)
    assert np.all(np.abs(np.asarray(m, np.float64) - rm) / sd <= bound)
    np.testing.assert_allclose(np.sqrt(np.diag(np.asarray(c, np.float64))), sd, rtol=bound.max())
