"""Secure aggregation inside FSGP's rounds on Flower's Deployment Engine: a real SuperLink and
three SuperNodes on 127.0.0.1, each exchange through SecAgg+ (four messages a node), the task
from ``tests.runtime.flower_tasks:secure_task`` (``Task.secure``) on the server and every node.
One FedAvg round and the aggregation round (about 75 s on 2 loaded cores; three rounds take
about 2 minutes, of which the run 80 to 90 s against 70 s for the same run in the clear). The
bounds are :mod:`tests.runtime.test_flower_secagg`'s.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

from fedppl.algorithms import exact, fsgp
from fedppl.runtime.deployment import LocalDeployment
from fedppl.runtime.secagg import error_bound

from . import flower_tasks
from .test_flower_deployment import _run
from .test_flower_secagg import SCALE, K, _fsgp_stats, _sums

jax.config.update("jax_enable_x64", True)


def test_secure_fsgp_on_the_real_engine(tmp_path):
    """The parameters (one FedAvg round of securely summed parameters) equal the plain embedded
    run's; the summed statistics equal the plain sum at them within the quantisation bound."""
    with LocalDeployment(K) as fed:
        result, got = _run(fed, tmp_path, task="tests.runtime.flower_tasks:secure_task",
                           method="fsgp", rounds=1)
    assert result["rejected"] == []
    _, want = flower_tasks.embedded("fsgp", rounds=1)
    like = fsgp.init(fsgp.init_params(np.zeros((5, 1))))  # the server state's structure
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), got)
    params = jax.tree_util.tree_leaves(state.params)
    for a, b in zip(params, want[:len(params)], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    _sums(_fsgp_stats(state.params), exact.Stats(*state.stats), error_bound(SCALE, K))
