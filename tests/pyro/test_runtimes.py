"""The Pyro port on the core's runtimes: what the core runs, a Pyro model runs, with no code of
the port's for it. Here the faults runtime (:class:`fedppl.runtime.faults.Faults`), which the
port did not have: clients that drop out and messages that arrive corrupted, refused by the
core's server and recorded by name, and the answer still the exact posterior."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedppl.pyro as fp
from fedppl.runtime.faults import Faults
from tests.pyro import models
from tests.pyro.conftest import key


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_a_pyro_model_runs_on_the_faults_runtime(schedule):
    pair = models.linear()  # conjugate: one accepted update puts a client's factor in place
    faults = Faults(dropout=0.3, corrupt=0.2, kinds=("nan", "huge", "improper"), seed=1)
    guide = fp.PVIGuide(pair.pyro, family="fullrank", dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="refused"):
        res = fp.PVI(pair.pyro, guide, schedule, elbo_samples=0).run(
            key(), pair.clients, 8, progress_bar=False, runtime=faults)
    names = pair.clients.names
    corrupted = {(r, names[k]) for r, k, f in faults.events if f != "dropped"}
    dropped = {(r, names[k]) for r, k, f in faults.events if f == "dropped"}
    refused = {(r, who) for r, who, why in res.rejected if "no message" not in why}
    lost = {(r, who) for r, who, why in res.rejected if "no message" in why}
    assert corrupted and dropped  # the drill had both kinds of fault
    assert refused == corrupted and lost == dropped
    assert np.asarray(res.history["rejected"]).sum() == len(res.rejected)
    # every client got an update through at some round: q is the exact posterior
    accepted = np.nan_to_num(res.history["step"]) > 0
    assert accepted.any(axis=0).all()
    mean, cov = res.mean_and_cov()
    exact_mean, exact_cov = models.exact_linear_posterior(*pair.arrays)
    np.testing.assert_allclose(mean.numpy(), exact_mean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(cov.numpy(), exact_cov, rtol=1e-6, atol=1e-9)
