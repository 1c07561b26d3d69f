"""``fp.EP``: the core's EP on a Pyro model, against the NumPyro core on the same model, data and
key (``tests/pyro/models.py``).

* Bayesian linear regression with the tilted moments in closed form: one undamped round is the
  exact posterior, as the NumPyro core's is.
* Logistic regression with NUTS on each tilted distribution: with the same key the chains see the
  same log density (torch's, to round-off), so the sites, and q, are the NumPyro core's to about
  1e-7 posterior sd after a round; the test allows 0.1 sd and 10%, the Monte Carlo error of the
  tilted moments, since round-off can send a chain down another trajectory.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedppl
import fedppl.pyro as fp
from fedppl.pyro.result import jax_key
from tests.pyro import models
from tests.pyro.conftest import key

F64 = torch.float64


def _both(pair, rounds, **kw):
    py = fp.EP(pair.pyro, fp.PVIGuide(pair.pyro, family="fullrank", dtype=F64), **kw).run(
        key(), pair.clients, rounds, progress_bar=False)
    np_ = fedppl.EP(pair.numpyro, fedppl.PVIGuide(pair.numpyro, family="fullrank"), **kw).run(
        jax_key(key()), pair.clients, rounds, progress_bar=False)
    return py, np_


def test_exact_tilted_ep_on_a_pyro_model_is_the_exact_posterior():
    pair = models.linear()
    py, np_ = _both(pair, 1, damping=1.0, tilted="exact")
    assert isinstance(py, fp.EPResult) and isinstance(py.q.nat1, torch.Tensor)
    exact_mean, exact_cov = models.exact_linear_posterior(*pair.arrays)
    mean, cov = (x.numpy() for x in py.mean_and_cov())
    np.testing.assert_allclose(mean, exact_mean, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(cov, exact_cov, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mean, np.asarray(np_.mean_and_cov()[0]), rtol=1e-9, atol=1e-12)


def test_nuts_ep_on_a_pyro_model_is_the_numpyro_cores():
    pair = models.logistic(n=100, k=3)
    py, np_ = _both(pair, 1, damping=1.0, num_warmup=50, num_samples=50, num_chains=2,
                    estimator="sample")  # the moments from the draws: no Hessian per draw
    mean, cov = (x.numpy() for x in py.mean_and_cov())
    ref_mean, ref_cov = (np.asarray(x) for x in np_.mean_and_cov())
    sd = np.sqrt(np.diag(ref_cov))
    assert np.max(np.abs(mean - ref_mean) / sd) < 0.1
    np.testing.assert_allclose(np.sqrt(np.diag(cov)) / sd, 1.0, atol=0.1)
    assert py.rejected == [] and np.all(py.history["converged"] == 1)
    np.testing.assert_allclose(py.history["rhat"], np_.history["rhat"], atol=0.02)
    # the result is the port's: torch draws, and the check runs on it
    assert py.sample(key(1), 10)["w"].shape == (10, 3)


def test_ep_refuses_exact_tilted_moments_for_a_non_gaussian_likelihood():
    pair = models.logistic(n=30, k=2)
    with pytest.raises(ValueError, match="tilted='exact' needs a Gaussian likelihood"):
        fp.EP(pair.pyro, fp.PVIGuide(pair.pyro, dtype=F64), tilted="exact").run(
            key(), pair.clients, 1, progress_bar=False)
