"""fedppl methods on Flower's Simulation Engine (Ray): the same answer as the embedded runtime
(faults, bad input and secure aggregation: ``test_flower_simulation_faults.py``).

Each simulation starts Ray (about 10 s on 2 cores), so each method runs once here. The issue's
four (PVI's two schedules, FSGP, FedBNR) always run; the DPO sparse GP and pFed-Mul (about 100 s
more each on 2 cores) run with the deployment suite when ``FEDPPL_FLOWER_FULL=1`` is set.
PVI's line search on Flower (one exchange a round by default, the adaptive search's
``evaluate`` exchanges) runs here too, on the module's Ray cluster, rather than in
``tests/infer/test_variational.py``, which would start Ray for it alone; so does a Pyro
model's PVI (the Pyro port on Flower).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

import fedppl
from fedppl.guides import PVIGuide
from fedppl.runtime.flower import FlowerApp
from tests.conftest import exact_linear_posterior, linear_model

from . import flower_tasks

# the module's simulations share one Ray cluster (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_ray_cluster")

jax.config.update("jax_enable_x64", True)


FULL = os.environ.get("FEDPPL_FLOWER_FULL") == "1"
ALWAYS = ("pvi-synchronous", "pvi-sequential", "fsgp", "fedbnr", "smc", "check")


@pytest.mark.parametrize("name", [
    n if n in ALWAYS or FULL else pytest.param(n, marks=pytest.mark.skip(
        reason="set FEDPPL_FLOWER_FULL=1 to run this method's simulation too"))
    for n in flower_tasks.TASKS])
def test_simulation_equals_embedded(name):
    """Same seeds, same clients: the server state after the rounds equals the embedded
    runtime's to float64 round-off (each client steps alone instead of under ``vmap``)."""
    app = FlowerApp(flower_tasks.task)
    result = app.simulate({"method": name})
    want_result, want = flower_tasks.embedded(name)
    got = [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype,
                                                                       jax.dtypes.prng_key)
                      else x) for x in jax.tree_util.tree_leaves(app.server_state)]
    want = [np.asarray(x) for x in want]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    assert result.num_rounds == want_result.num_rounds
    assert result.rejected == want_result.rejected == []
    for key in ("messages_up", "messages_down", "bytes_up", "bytes_down"):
        np.testing.assert_array_equal(result.history[key], want_result.history[key])
    # what crossed the wire: at least the payload the method counts
    assert np.all(result.history["wire_bytes_up"] >= result.history["bytes_up"])
    # the server compiles its update in the first round only (later rounds reuse it)
    compiles = np.asarray(result.history["server_compiles"])
    assert compiles[0] > 0 and np.all(compiles[1:] == 0), compiles
    # the server set up without the data (a set-up that reads them is refused:
    # tests/infer/test_sgp_edge_cases.py), so figures that need them are NaN
    need_data = {"pvi-synchronous": "elbo", "pvi-sequential": "elbo", "fsgp": "bound",
                 "sgp-dpo": "free_energy", "pfedmul": "exact_elbo"}
    if name in need_data:
        assert np.all(np.isnan(np.asarray(result.history[need_data[name]], float)[1:]))
        assert not np.any(np.isnan(np.asarray(want_result.history[need_data[name]], float)[1:]))


# -- PVI's line search on Flower (its embedded counterparts: tests/infer/test_variational.py) --


def _flower_blr_task(run_config):
    """Bayesian linear regression on 3 Flower nodes, synchronous PVI with damping 0.5 and the
    default line search."""
    from fedppl.runtime.flower import Task

    jax.config.update("jax_enable_x64", True)
    clients = _flower_blr_clients()
    pvi = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"), "synchronous",
                     0.5, elbo_samples=0)
    return Task(pvi, clients.client, clients.num_clients, FLOWER_ROUNDS,
                run_kwargs={"progress_bar": False})


FLOWER_ROUNDS = 10


def _flower_blr_clients():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=120)
    return fedppl.partition.homogeneous(X, y, 3, seed=0)


def _counted_exchanges(monkeypatch) -> list[str]:
    """The message types of the Flower server's exchanges, appended as they happen."""
    from fedppl.runtime import flower

    exchanged: list[str] = []
    real = flower._Server._exchange

    def counted(self, contents, message_type, *args, **kwargs):
        exchanged.append(message_type)
        return real(self, contents, message_type, *args, **kwargs)

    monkeypatch.setattr(flower._Server, "_exchange", counted)
    return exchanged


def test_flower_default_sends_one_exchange_per_round(monkeypatch):
    """On Flower's Simulation Engine, synchronous PVI with the default line search exchanges
    with its nodes once a round (no ``evaluate`` exchange), and reaches the embedded runtime's
    answer: with damping 0.5 and the closed-form step, ``q = p * prod_k t_k^(1 - 2^-R)`` after R
    rounds, the exact posterior to 2^-R."""
    pytest.importorskip("flwr")
    from fedppl.runtime import flower

    exchanged = _counted_exchanges(monkeypatch)
    result = flower.FlowerApp(_flower_blr_task).simulate()
    assert exchanged.count("train") == FLOWER_ROUNDS and "evaluate" not in exchanged, exchanged
    assert result.history["exchanges"].tolist() == [1] * FLOWER_ROUNDS
    clients = _flower_blr_clients()
    X, y = (np.concatenate(a) for a in zip(*(clients.client(k) for k in range(3)), strict=True))
    share = 1 - 0.5**FLOWER_ROUNDS
    prec = np.eye(3) + share * X.T @ X / 0.5**2
    np.testing.assert_allclose(result.q.prec, prec, rtol=1e-10)
    np.testing.assert_allclose(result.q.nat1, share * X.T @ y / 0.5**2, rtol=1e-10)
    embedded = _flower_blr_task({}).method.run(jax.random.key(0), clients, FLOWER_ROUNDS,
                                               progress_bar=False)
    np.testing.assert_allclose(result.q.prec, embedded.q.prec, rtol=1e-10)
    np.testing.assert_allclose(result.q.nat1, embedded.q.nat1, rtol=1e-10)
    exact_mean, _ = exact_linear_posterior(X, y)
    np.testing.assert_allclose(result.mean_and_cov()[0], exact_mean, rtol=2e-3)


def _flower_sampled_task(run_config):
    """The same regression on 3 unequal nodes, one node a round (damping 1): a round whose
    node moves q further than the last round's did is flagged and scored."""
    from fedppl.runtime.flower import Task

    jax.config.update("jax_enable_x64", True)
    clients = _flower_unequal_clients()
    pvi = fedppl.PVI(linear_model, PVIGuide(linear_model, family="fullrank"), "synchronous",
                     elbo_samples=0, clients_per_round=1,
                     line_search=run_config.get("line-search"))
    return Task(pvi, clients.client, clients.num_clients, 5, run_kwargs={"progress_bar": False})


def _flower_unequal_clients():
    clients = _flower_blr_clients()
    X, y = (np.concatenate(a) for a in zip(*(clients.client(k) for k in range(3)), strict=True))
    return fedppl.Clients.from_list([(X[:10], y[:10]), (X[10:50], y[10:50]), (X[50:], y[50:])])


@pytest.mark.skipif(os.environ.get("FEDPPL_FLOWER_FULL") != "1",
                    reason="set FEDPPL_FLOWER_FULL=1 to run this Flower simulation too")
def test_flower_adaptive_line_search_scores_the_flagged_rounds(monkeypatch):
    """On Flower, a flagged round's scores come from one ``evaluate`` exchange (the candidates
    in one batch), the other rounds need none, and the run equals the embedded runtime's with
    ``line_search="adaptive"``."""
    pytest.importorskip("flwr")
    from fedppl.runtime import flower

    exchanged = _counted_exchanges(monkeypatch)
    result = flower.FlowerApp(_flower_sampled_task).simulate()
    scored = result.history["exchanges"] == 2
    assert 0 < scored.sum() < len(scored), result.history["exchanges"]
    assert exchanged.count("evaluate") == scored.sum() and exchanged.count("train") == 5
    want = _flower_sampled_task({"line-search": "adaptive"}).method.run(
        jax.random.key(0), _flower_unequal_clients(), 5, progress_bar=False)
    np.testing.assert_array_equal(result.history["exchanges"], want.history["exchanges"])
    np.testing.assert_allclose(result.q.prec, want.q.prec, rtol=1e-10)
    np.testing.assert_allclose(result.q.nat1, want.q.nat1, rtol=1e-10)


# -- a Pyro model: the Pyro port's PVI is the core's plan, so Flower runs it as the core's ---------

PYRO_ROUNDS = 3


def _pyro_clients():
    from tests.pyro import models

    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + models.NOISE * rng.normal(size=60)
    return fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)


def _pyro_pvi():
    import torch

    import fedppl.pyro as fp
    from tests.pyro import models

    guide = fp.PVIGuide(models.linear_py, family="fullrank", dtype=torch.float64)
    return fp.PVI(models.linear_py, guide, "synchronous", damping=0.5, elbo_samples=0)


def _pyro_task(run_config):  # built on the server and on every node
    from fedppl.runtime.flower import Task

    jax.config.update("jax_enable_x64", True)
    clients = _pyro_clients()
    return Task(_pyro_pvi(), clients.client, clients.num_clients, PYRO_ROUNDS,
                run_kwargs={"progress_bar": False})


def test_a_pyro_model_on_flower_is_the_embedded_and_the_numpyro_run():
    """A Pyro model on the Simulation Engine: the answer is the embedded runtime's (to
    round-off) and the NumPyro core's (Bayesian linear regression: both the exact posterior)."""
    pytest.importorskip("pyro", reason="the Pyro port needs the pyro extra")
    import fedppl.pyro as fp
    from tests.pyro import models

    clients = _pyro_clients()
    got = FlowerApp(_pyro_task).simulate()
    # Flower hands every method jax.random.key(seed): the port takes it as its key
    embedded = _pyro_pvi().run(jax.random.key(0), clients, PYRO_ROUNDS, progress_bar=False)
    numpyro = fedppl.PVI(models.linear_np, fedppl.PVIGuide(models.linear_np, family="fullrank"),
                         "synchronous", damping=0.5, elbo_samples=0).run(
        jax.random.key(0), clients, PYRO_ROUNDS, progress_bar=False)
    assert isinstance(got, fp.PVIResult) and got.rejected == []
    mean, cov = (x.numpy() for x in got.mean_and_cov())
    for other in (embedded.mean_and_cov(), numpyro.mean_and_cov()):
        np.testing.assert_allclose(mean, np.asarray(other[0]), rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(cov, np.asarray(other[1]), rtol=1e-9, atol=1e-10)
    for key in ("messages_up", "bytes_up", "bytes_down"):
        np.testing.assert_array_equal(got.history[key], embedded.history[key])


def test_the_module_runs_on_one_ray_cluster(one_ray_cluster):
    """The simulations above started Ray once between them (tests/conftest.py)."""
    assert one_ray_cluster.get("count", 0) <= 1, one_ray_cluster
