"""Every Flower task on the Deployment Engine (a SuperLink and three SuperNodes on 127.0.0.1,
each beside its warm ClientApp process) equals the embedded runtime: PVI (both schedules), FSGP,
FedBNR, the DPO sparse GP and pFed-Mul.

They run when ``FEDPPL_FLOWER_FULL=1`` is set; ``make test`` runs the Deployment Engine's own
tests (``test_flower_deployment.py``: warm processes, faults) and every task on the Simulation
Engine, whose ServerApp and ClientApp are the same code.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")
from fedppl.runtime.deployment import LocalDeployment

from . import flower_tasks
from .test_flower_deployment import APP

pytestmark = pytest.mark.skipif(os.environ.get("FEDPPL_FLOWER_FULL") != "1",
                                reason="set FEDPPL_FLOWER_FULL=1 to run every task on the "
                                       "Deployment Engine (about ten minutes)")


@pytest.fixture(scope="module")
def fed():
    with LocalDeployment(3) as deployment:
        yield deployment


@pytest.mark.parametrize("name", flower_tasks.TASKS)
def test_deployment_equals_embedded(fed, tmp_path, name):
    out = tmp_path / "out"
    fed.run(APP, {"method": name, "result-dir": str(out)}, timeout=900)
    result = json.loads((out / "result.json").read_text())
    with np.load(out / "state.npz") as f:
        got = [f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))]
    want_result, want = flower_tasks.embedded(name)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            b = jax.random.key_data(b)
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-9, atol=1e-10)
    assert result["rejected"] == []
    assert len(result["history"]["round"]) == want_result.num_rounds
