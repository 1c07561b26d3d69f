"""Synchronous PVI with Flower's SecAgg+ inside its rounds (``Task.secure``), on the Simulation
Engine (one Ray cluster for the module's two simulations).

Bayesian linear regression on three nodes, three rounds, node 1's message NaN in round 2: the node
refuses it before masking (naming itself), SecAgg+ goes on without it, and the server's
posterior equals the plain embedded run in which client 1 sat round 2 out, within the
quantisation bound. The ServerApp received masked integer vectors only, none of them a client's
own quantised summand.

The importance check (one round from the prior) through SecAgg+: the server holds each draw's
log-likelihood summed over the nodes, equal to the plain check's sum within the bound.

DP-PVI's noise distributed over the sum (``distributed=3``; node 1's message NaN in round 2):
node 1 withholds it, and the total of the other two, short of the assumed noise, is refused.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

import fedppl
from fedppl.algorithms.pvi import NOISE_SHORT, REFUSALS
from fedppl.families.gaussian import is_finite, is_pd
from fedppl.models import linear_regression
from fedppl.runtime.faults import corrupt
from fedppl.runtime.secure import QUANTIZATION, SecureSum, secure_form, sum_error

from . import flower_tasks
from .test_flower_secagg import _masked, _simulate
from .test_secure_dp import _pvi as _dp_pvi

# the module's two simulations share one Ray cluster (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_ray_cluster")

jax.config.update("jax_enable_x64", True)

SCALE, K, ROUNDS = 1e3, 3, 3


def secure_pvi_task(run_config: dict[str, Any]):
    """PVI, synchronous, no line search, through SecAgg+; node 1 sends NaN in round 2."""
    base = flower_tasks.task({"method": "pvi-synchronous", "line-search": False})
    nan = partial(corrupt, kind="nan")
    return base._replace(secure=SecureSum(SCALE), num_rounds=ROUNDS,
                         fault=lambda k, r: nan if (k, r) == (1, 2) else None)


@pytest.fixture(scope="module")
def run(one_ray_cluster):
    with pytest.MonkeyPatch.context() as mp, pytest.warns(RuntimeWarning):
        result, state, received = _simulate(mp, secure_pvi_task, {})
    return result, state, received


def test_secure_pvi_on_flower_equals_the_plain_run(run):
    """The posterior equals the plain embedded run with client 1 out of round 2, within the
    sums' quantisation bound; client 1's refusal is recorded with its own reason."""
    result, state, _ = run
    want, _ = flower_tasks.embedded("pvi-synchronous", ROUNDS, absent={2: [1]},
                                    line_search=False)
    bound = ROUNDS * sum_error(SCALE, K)
    for a, b in zip(jax.tree_util.tree_leaves(state.q), jax.tree_util.tree_leaves(want.q),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=bound)
    assert [(r, who) for r, who, _ in result.rejected] == [(2, "client 1")]
    assert "partition 1: refused at the client before secure aggregation: message not finite" \
        in result.rejected[0][2]
    covered = np.ones((ROUNDS, K), bool)
    covered[1, 1] = False
    assert np.all(np.isnan(result.history["free_energy"][covered]))  # it stayed at the clients


def test_the_server_received_only_masked_vectors(run):
    """Every vector the ServerApp received is masked: none agrees with any client's own
    quantised summand of round 1 (the plain run's first messages, clipped and judged as a
    node does) on more than a couple of entries (SecAgg+'s self-masks hide even their plain
    sum: only the unmasking stage's shares give the server the total)."""
    _, _, received = run
    masked = _masked(received)
    assert len(masked) == K * ROUNDS - 1  # client 1 sent nothing in round 2
    clients, _ = flower_tasks._data("pvi-synchronous")
    method = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression),
                        schedule="synchronous", line_search=False)
    start = method.init(jax.random.key(0), clients)
    after, _ = method.update(start)
    form = secure_form(method, after.log.last_messages, SecureSum(SCALE))
    own = []
    for k in range(K):
        msg = form.prepare(start.server, jax.tree_util.tree_map(lambda x, k=k: x[k],
                                                                after.log.last_messages))
        summand, ok = form.summand(start.server, msg)
        assert float(ok) > 0
        flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(summand)])
        own.append(np.rint((flat / SCALE + 1.0) * (QUANTIZATION // 2)).astype(np.int64))
    for vector in masked[:K]:  # round 1's
        assert vector.shape == own[0].shape
        assert all(np.sum(vector == mine) <= 2 for mine in own)


CHECK_SCALE = 1e4  # above every client's |log-likelihood| at the prior's draws here


def secure_check_task(run_config: dict[str, Any]):
    """The importance check (one round from the prior) through SecAgg+."""
    base = flower_tasks.task({"method": "check"})
    return base._replace(secure=SecureSum(CHECK_SCALE), num_rounds=1)


def test_the_check_on_flower_receives_only_the_total():
    """The check through SecAgg+ on the Simulation Engine: the server holds each draw's
    log-likelihood summed over the three nodes, equal to the plain embedded check's sum within
    the quantisation bound, from masked vectors only; leave-one-client-out is refused."""
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # k-hat's advice: q is the prior
        result, _, received = _simulate(mp, secure_check_task, {})
        want, _ = flower_tasks.embedded("check", 1)
    assert result.summed and result.log_lik.shape == (1, 200) and result.rejected == []
    np.testing.assert_array_equal(result.draws, want.draws)
    np.testing.assert_allclose(result.log_lik[0], want.log_lik.sum(0), rtol=0,
                               atol=sum_error(CHECK_SCALE, K))
    assert len(_masked(received)) == K
    with pytest.raises(ValueError, match="secure aggregation withholds"):
        result.loo()


def secure_dp_task(run_config: dict[str, Any]):
    """DP-PVI's virtual parties with the noise distributed over the three nodes' secure sum
    (``distributed=3``, :mod:`tests.runtime.test_secure_dp`'s settings); node 1's message NaN
    in round 2."""
    base = flower_tasks.task({"method": "pvi-synchronous", "line-search": False})
    nan = partial(corrupt, kind="nan")
    return base._replace(method=_dp_pvi(1.0, K), secure=SecureSum(SCALE), num_rounds=ROUNDS,
                         fault=lambda k, r: nan if (k, r) == (1, 2) else None)


def test_distributed_dp_a_total_short_of_noise_is_refused():
    """On the Simulation Engine through SecAgg+ (``t = 3`` of three nodes; node 1's message
    NaN in round 2): node 1 withholds its message, naming the reason, and the total of the other
    two carries two thirds of the assumed noise, so the server refuses it for both; rounds 1 and
    3 are applied. The ServerApp received masked vectors only; the accounting is the
    simulation's (the nodes' noise is their own: each folds a secret into its key, so the
    posterior is not the simulation's)."""
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result, state, received = _simulate(mp, secure_dp_task, {})
    short = REFUSALS[NOISE_SHORT]
    rejected = {(r, who): why for r, who, why in result.rejected}
    assert sorted(rejected) == [(2, "client 0"), (2, "client 1"), (2, "client 2")]
    assert rejected[(2, "client 0")] == rejected[(2, "client 2")] == short
    assert ("partition 1: refused at the client before secure aggregation: message not finite"
            in rejected[(2, "client 1")])
    steps = np.asarray(result.history["step"])
    assert np.all(steps[[0, 2]] > 0) and np.all(steps[1] <= 0)
    assert len(_masked(received)) == 3 * ROUNDS - 1
    assert bool(is_pd(state.q)) and bool(is_finite(state.q))
    assert result.privacy["distributed"] == 3
    assert result.privacy["worst_message_epsilon"] > result.privacy["worst_epsilon"] > 0
