"""Secure aggregation (Flower's SecAgg+) inside FSGP's and FedBNR's rounds (``Task.secure``).

Each secure exchange's sum is exact to ``error_bound(scale, n) = n * scale * 2**-42`` per entry
(two limbs of SecAgg+'s ``2**22`` levels: :mod:`fedppl.runtime.secagg`). The tests hold the
statistics a server sums to that bound against the plain sum at the same parameters, where a
missing client moves the sum by far more, and the rest of the state (the parameters learnt by
FedAvg through the same secure sums) to the embedded runtime's to 1e-8. They record what the
ServerApp receives from the nodes: masked integer vectors, never a client's own message.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

import fedppl
from fedppl.algorithms import exact, fedbnr, fsgp
from fedppl.runtime import flower
from fedppl.runtime.flower import FlowerApp
from fedppl.runtime.flower_node import secure_form
from fedppl.runtime.flower_wire import RECORD
from fedppl.runtime.secagg import QUANTIZATION, error_bound

from . import flower_tasks

# the module's simulations share one Ray cluster (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_ray_cluster")

jax.config.update("jax_enable_x64", True)

SCALE, K = flower_tasks.SECURE_SCALE, 3


class _Recorder:
    """A ServerApp's grid that keeps every message the nodes send it."""

    def __init__(self, grid, got: list):
        self.grid, self.got = grid, got

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.got.extend(replies)
        return replies

    def pull_messages(self, ids):
        replies = list(self.grid.pull_messages(ids))
        self.got.extend(replies)
        return replies


def _simulate(monkeypatch, task, config):
    """The app on the Simulation Engine, with what its ServerApp received from the nodes."""
    got: list = []
    init = flower._Server.__init__
    monkeypatch.setattr(flower._Server, "__init__",
                        lambda self, grid, task: init(self, _Recorder(grid, got), task))
    app = FlowerApp(task)
    result = app.simulate(config)
    return result, app.server_state, [m.content for m in got if not m.has_error()]


def _masked(received: list) -> list[np.ndarray]:
    """The masked vectors (their high limbs) among what the server received; and a check that
    it received no array: no client's message, statistics or value in the clear."""
    for content in received:
        assert all(len(rec) == 0 for rec in content.array_records.values()), \
            list(content.array_records)
        trees = content.config_records.get(RECORD, {})  # fedppl's own trees travel as bytes
        assert not any(isinstance(v, bytes) for v in trees.values()), list(trees)
    return [bytes_to_ndarray(c.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS][1])
            for c in received if RECORD_KEY_CONFIGS in c.config_records
            and Key.MASKED_PARAMETERS in c.config_records[RECORD_KEY_CONFIGS]]


def _high_limb(summand) -> np.ndarray:
    """A summand's high limb as SecAgg+ quantises it before masking."""
    flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(summand)])
    return np.rint((flat / SCALE + 1.0) * (QUANTIZATION // 2)).astype(np.int64)


def _sums(stats: list, total, bound: float) -> None:
    """``total`` is the sum of ``stats`` to ``bound`` per entry; without any one of them it is
    not (the bound catches a missing client)."""
    want = exact.aggregate(stats)
    for a, b in zip(total, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=bound)
    for k in range(len(stats)):
        rest = exact.aggregate([s for j, s in enumerate(stats) if j != k])
        assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(total, rest, strict=True)) > 1e3 * bound


def _fsgp_stats(params, ks=range(K)) -> list:
    clients, _ = flower_tasks._data("fsgp")
    return [fsgp.client_stats(params, *map(jnp.asarray, clients.client(k))) for k in ks]


def test_fsgp_secure_rounds(monkeypatch):
    """FSGP with every round through SecAgg+: the parameters (three FedAvg rounds of securely
    summed, count-weighted parameters) equal the plain embedded run's; the summed statistics
    equal the plain sum at those parameters within the bound; the server received only masked
    vectors, none of them a client's own quantised statistics."""
    result, state, received = _simulate(monkeypatch, flower_tasks.secure_task,
                                        {"method": "fsgp"})
    assert result.rejected == []
    _, want = flower_tasks.embedded("fsgp")
    got = jax.tree_util.tree_leaves(state.params)
    for a, b in zip(got, want[:len(got)], strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-8, atol=1e-10)
    stats = _fsgp_stats(state.params)
    _sums(stats, state.stats, error_bound(SCALE, K))
    masked = _masked(received)
    assert len(masked) == K * (flower_tasks.ROUNDS + 1)  # every round and the aggregation's
    zero = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    own = [_high_limb(fsgp.secure_summand(state, fsgp.Message(zero, s))[0]) for s in stats]
    for vector in masked[-K:]:  # the aggregation round's
        assert all(np.sum(vector == mine) <= 1 for mine in own)


def test_fedbnr_secure_rounds(monkeypatch):
    """FedBNR (shared kernel, global last layer) with its kernels and its statistics through
    SecAgg+: the kernels equal the plain embedded run's; the global last layer is the exact
    posterior of the plain sum of the clients' statistics under them within the bound; the
    server received only masked vectors."""
    result, state, received = _simulate(monkeypatch, flower_tasks.secure_task,
                                        {"method": "fedbnr"})
    assert result.rejected == []
    want, _ = flower_tasks.embedded("fedbnr")
    for a, b in zip(jax.tree_util.tree_leaves(result.kernels),
                    jax.tree_util.tree_leaves(want.kernels), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-8, atol=1e-10)
    assert result.best_round == want.best_round
    clients, _ = flower_tasks._data("fedbnr")
    best = jax.tree_util.tree_map(lambda x: x[0], state.best)
    stats = [fedbnr.client_stats(best.kernel, state.omega, *map(jnp.asarray, clients.client(k)),
                                 jnp.ones(clients.sizes[k])) for k in range(K)]
    # the layer's natural parameters are the sums over sigma^2 (plus the prior's precision)
    layer = jax.tree_util.tree_map(lambda x: x[0], state.last_layer.global_)
    s2 = float(best.noise) ** 2
    total = exact.Stats((layer.prec - jnp.eye(layer.prec.shape[0]) / best.prior_scale**2) * s2,
                        layer.nat1 * s2, exact.aggregate(stats).count)
    _sums(stats, total, error_bound(SCALE, K) + 1e-12 * float(jnp.max(jnp.abs(layer.prec))) * s2)
    masked = _masked(received)
    assert len(masked) == 2 * K * flower_tasks.ROUNDS  # each round's kernels and statistics


def test_a_node_beyond_the_scale_is_named_and_left_out(monkeypatch):
    """A node whose statistics exceed the public scale refuses to send them, naming itself; the
    secure sum goes on without it (SecAgg+ removes its masks) and covers the other two."""

    def task(run_config):
        base = flower_tasks.secure_task({"method": "fsgp", "rounds": 1})
        big = lambda m: jax.tree_util.tree_map(lambda x: 1e6 * x, m)  # noqa: E731
        return base._replace(fault=lambda k, r: big if (k, r) == (1, 2) else None)

    with pytest.warns(RuntimeWarning, match="rejected statistics from client 1"):
        result, state, _ = _simulate(monkeypatch, task, {})
    why = {(r, who): reason for r, who, reason in result.rejected}
    assert list(why) == [(2, "client 1")]
    assert "partition 1: .stats.scatter reaches" in why[(2, "client 1")]
    assert "beyond the task's scale 1000" in why[(2, "client 1")]
    _sums(_fsgp_stats(state.params, [0, 2]), state.stats, error_bound(SCALE, 2))


def test_methods_whose_server_needs_each_message_are_refused():
    """A message that is none of the secure forms' (PVI's server judges each message it cannot
    read as a delta: here a stand-in) and FedBNR's 'kd' kernel (it distils each client's
    kernel) cannot run on the sum alone, and each says so (synchronous PVI's own delta has a
    secure form: tests/runtime/test_secure_pvi.py)."""
    from fedppl.models import linear_regression as model
    from fedppl.models.random_features import URKSpec

    pvi = fedppl.PVI(model, fedppl.PVIGuide(model))
    with pytest.raises(ValueError, match="PVI's server needs each client's message"):
        secure_form(pvi, object())
    spec = URKSpec(input_dim=1, feature_widths=(), shift_widths=(), num_samples=4)
    like = fedbnr.KernelMessage(None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kernel='kd'"):
        secure_form(fedppl.FedBNR(spec, kernel="kd"), like)
    assert secure_form(fedppl.FedBNR(spec), like).summand is fedbnr.secure_summand


def test_a_secure_node_refuses_to_answer_in_the_clear():
    """A node whose task is secure answers only messages that ask for SecAgg+ at its scale."""
    from types import SimpleNamespace

    from flwr.app import RecordDict

    from fedppl.runtime.flower_node import secure_request
    from fedppl.runtime.secagg import SecureSum, request

    node = SimpleNamespace(task=flower_tasks.secure_task({"method": "fsgp"}), partition=2)
    with pytest.raises(ValueError, match=r"partition 2: .* in the clear"):
        secure_request(node, RecordDict())
    with pytest.raises(ValueError, match=r"partition 2: the server asked for scale 1\.0"):
        secure_request(node, request(RecordDict(), SecureSum(1.0), "train"))
    asked = secure_request(node, request(RecordDict(), SecureSum(SCALE), "evaluate"))
    assert asked == {"scale": SCALE, "exchange": "evaluate"}
