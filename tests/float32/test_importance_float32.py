"""The check and the refinement in float32 (x64 off; see ``conftest.py``): the clients' log
likelihoods and the draws are float32, the weights are formed in float64 on the host. With q
exact the check gives equal weights to the log-likelihoods' rounding (k-hat small, corrected
moments within Monte Carlo error of the float64 posterior); with q too narrow it flags it and
refine corrects it; with local sites the Laplace step converges in float32."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np
import pytest

import fedppl
from fedppl.families import gaussian as g
from tests.conftest import linear_model, random_intercepts
from tests.float32.conftest import assert_dtype
from tests.reference import grid_posterior

pytestmark = pytest.mark.usefixtures("no_x64")


def test_check_and_refine_in_float32():
    rng = np.random.default_rng(0)
    D = 6
    X = rng.normal(size=(200, D)).astype(np.float32)
    y = (X @ rng.normal(size=D) + 0.5 * rng.normal(size=200)).astype(np.float32)
    clients = fedppl.partition.homogeneous(X, y, num_clients=4, seed=0)
    res = fedppl.PVI(linear_model, fedppl.PVIGuide(linear_model, family="fullrank")).run(
        jax.random.key(0), clients, 2, progress_bar=False)
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    cov = np.linalg.inv(np.eye(D) + X64.T @ X64 / 0.25)
    mean, sd = cov @ X64.T @ y64 / 0.25, np.sqrt(np.diag(cov))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check = res.check(jax.random.key(1), clients, num_draws=1000)
    assert check.khat < 0.5 and check.ess > 900
    assert_dtype(check.draws, np.float32)
    m, c = check.mean_and_cov()
    assert np.max(np.abs(m - mean) / sd) < 0.15
    m0, c0 = res.mean_and_cov()
    narrow = dataclasses.replace(res, q=g.FullGaussian.from_moments(m0, c0 / 4))
    refined = narrow.refine(jax.random.key(1), clients, num_rounds=10, num_draws=2000,
                            method="importance",
                            ess_target=2000, progress_bar=False, warn=False)
    m, c = refined.mean_and_cov()
    assert refined.history["khat"][0] > 0.7 and refined.khat < 0.5
    assert np.max(np.abs(m - mean) / sd) < 0.1
    assert np.max(np.abs(np.sqrt(np.diag(c)) / sd - 1)) < 0.1


def test_local_sites_in_float32():
    rng = np.random.default_rng(3)
    J, n = 12, 4
    groups = [0.5 + 0.3 * rng.normal() + rng.normal(size=n) for _ in range(J)]
    parts = [(np.repeat([0, 1], n), np.concatenate([groups[2 * k], groups[2 * k + 1]]
                                                   ).astype(np.float32))
             for k in range(J // 2)]
    clients = fedppl.Clients.from_list(parts)
    guide = fedppl.PVIGuide(random_intercepts, ("mu", "tau"), family="fullrank")
    res = fedppl.PVI(random_intercepts, guide).run(jax.random.key(0), clients, 8,
                                                   progress_bar=False, n_groups=2)
    refined = res.refine(jax.random.key(2), clients, num_rounds=8, num_draws=1000,
                         method="importance",
                         progress_bar=False)
    assert np.all(np.isfinite(refined.log_lik))
    mean, sd = grid_posterior(groups)
    m, c = refined.mean_and_cov()
    assert np.all(np.abs(m - mean) / sd < 0.15), (m, mean, sd)
    assert np.all(np.abs(np.sqrt(np.diag(c)) / sd - 1) < 0.15)
