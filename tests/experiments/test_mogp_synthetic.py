"""The synthetic study's claims (Sec. 5.2.1 and 5.4 of the pFed-Mul paper)."""

from __future__ import annotations

import numpy as np
import pytest

from fedppl_experiments import mogp_synthetic as ms

SMALL = dict(seed=0, rounds=4, n_per_task=30, num_inducing=20)


@pytest.fixture(scope="module")
def results():
    return {m: ms.run(m, **SMALL) for m in ms.METHODS}


def test_truth_uses_paper_hyperparameters_and_shapes():
    data = ms.generate(seed=1, num_clients=5, n_per_task=10, grid_size=50)
    assert data.clients.num_clients == 5 and data.f_grid.shape == (2, 50)
    assert ms.TRUTH == {"noise": 0.1, "W": [[0.6, 0.4], [0.4, 0.6]], "phi0": [1.0, 2.0],
                        "phi1": [0.02, 0.01]}
    _, y, task = data.clients.data[0]
    y = y[task == 1]
    assert set(np.unique(y)) <= {0.0, 1.0}


def test_multitask_classification_posterior_beats_single_task(results):
    mul, st = results["pfed-mul"], results["pfed-st"]
    assert mul["cls_rmse"] < 0.8 * st["cls_rmse"]
    assert mul["cls_var"] < 0.5 * st["cls_var"]


def test_pfedmul_converges_in_fewer_rounds_than_gaussian_vi(results):
    mul, gvi = results["pfed-mul"], results["gaussian-vi"]
    r_mul = mul["rounds_to_convergence"]
    r_gvi = gvi["rounds_to_convergence"] or SMALL["rounds"] + 1
    assert r_mul is not None and r_mul < r_gvi
    assert mul["elbo_per_obs"][0] > gvi["elbo_per_obs"][-1]  # one round beats all of Adam's


def test_rounds_to_convergence():
    assert ms.rounds_to_convergence([0.0, 1.0, 1.0, 1.0], 1e-3) == 2
    assert ms.rounds_to_convergence([0.0, 0.5, 1.0], 1e-3) is None
    assert ms.rounds_to_convergence([1.0, 1.0], 1e-3) == 1
