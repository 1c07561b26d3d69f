"""fedppl methods on Flower's Simulation Engine (Ray): the same answer as the embedded runtime
(faults, bad input and secure aggregation: ``test_flower_simulation_faults.py``).

Each simulation starts Ray (about 10 s on 2 cores), so each method runs once here. The issue's
four (PVI's two schedules, FSGP, FedBNR) always run; the DPO sparse GP and pFed-Mul (about 100 s
more each on 2 cores) run with the deployment suite when ``FEDPPL_FLOWER_FULL=1`` is set.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

from fedppl.runtime.flower import FlowerApp

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


def test_the_module_runs_on_one_ray_cluster(one_ray_cluster):
    """The simulations above started Ray once between them (tests/conftest.py)."""
    assert one_ray_cluster.get("count", 0) <= 1, one_ray_cluster
