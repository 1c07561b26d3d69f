"""Synchronous PVI with SecAgg+ inside its rounds on Flower's Deployment Engine: a real SuperLink
and three SuperNodes on 127.0.0.1, the task ``tests.runtime.flower_tasks:secure_task`` (PVI,
``line-search`` off) on the server and every node, two rounds. The Simulation Engine's test and
the bounds: ``test_flower_secure_pvi.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

from fedppl.runtime.deployment import LocalDeployment
from fedppl.runtime.secure import sum_error

from . import flower_tasks
from .test_flower_deployment import _run

jax.config.update("jax_enable_x64", True)

K, ROUNDS = 3, 2


def test_secure_pvi_on_the_real_engine(tmp_path):
    """q (the server state's first two leaves: its natural parameters) equals the plain embedded
    run's within the secure sums' quantisation bound, not bit for bit."""
    with LocalDeployment(K) as fed:
        result, got = _run(fed, tmp_path, task="tests.runtime.flower_tasks:secure_task",
                           method="pvi-synchronous", rounds=ROUNDS, **{"line-search": False})
    assert result["rejected"] == []
    _, want = flower_tasks.embedded("pvi-synchronous", rounds=ROUNDS, line_search=False)
    bound = ROUNDS * sum_error(flower_tasks.SECURE_SCALE, K)
    gaps = [float(np.max(np.abs(a - b))) for a, b in zip(got[:2], want[:2], strict=True)]
    assert max(gaps) <= bound and max(gaps) > 0, gaps
    # the local free energy stayed at the clients (NaN, which the result's JSON writes as null)
    assert all(v is None for row in result["history"]["free_energy"] for v in row)
