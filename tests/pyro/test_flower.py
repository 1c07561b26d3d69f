"""A Pyro model on Flower's Simulation Engine: the port's PVI is the core's plan, so Flower runs
it as it runs the core's, and the answer is the embedded runtime's (to round-off) and the
NumPyro core's (Bayesian linear regression: both the exact posterior). One simulation (Ray
starts in about 10 s on 2 cores)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import fedppl
import fedppl.pyro as fp
from tests.pyro import models

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

from fedppl.runtime.flower import FlowerApp, Task

ROUNDS = 3


def _clients() -> fedppl.Clients:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + models.NOISE * rng.normal(size=60)
    return fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)


def _pvi() -> fp.PVI:
    guide = fp.PVIGuide(models.linear_py, family="fullrank", dtype=torch.float64)
    return fp.PVI(models.linear_py, guide, "synchronous", damping=0.5, elbo_samples=0)


def task(run_config):  # built on the server and on every node
    jax.config.update("jax_enable_x64", True)
    clients = _clients()
    return Task(_pvi(), clients.client, clients.num_clients, ROUNDS,
                run_kwargs={"progress_bar": False})


def test_a_pyro_model_on_flower_is_the_embedded_and_the_numpyro_run():
    clients = _clients()
    got = FlowerApp(task).simulate()
    # Flower hands every method jax.random.key(seed): the port takes it as its key
    embedded = _pvi().run(jax.random.key(0), clients, ROUNDS, progress_bar=False)
    numpyro = fedppl.PVI(models.linear_np, fedppl.PVIGuide(models.linear_np, family="fullrank"),
                         "synchronous", damping=0.5, elbo_samples=0).run(
        jax.random.key(0), clients, ROUNDS, progress_bar=False)
    assert isinstance(got, fp.PVIResult) and got.rejected == []
    mean, cov = (x.numpy() for x in got.mean_and_cov())
    for other in (embedded.mean_and_cov(), numpyro.mean_and_cov()):
        np.testing.assert_allclose(mean, np.asarray(other[0]), rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(cov, np.asarray(other[1]), rtol=1e-9, atol=1e-10)
    for key in ("messages_up", "bytes_up", "bytes_down"):
        np.testing.assert_array_equal(got.history[key], embedded.history[key])
