"""fedppl on Flower's Simulation Engine (Ray): faults, bad input and secure aggregation.

The equality runs are in ``test_flower_simulation.py``; these are a separate file so that
``pytest -n 2 --dist loadfile`` can run the two halves on different workers.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

from flwr.app import RecordDict

from fedppl.runtime.faults import corrupt
from fedppl.runtime.flower import FlowerApp, FlowerError, Task, pack, unpack
from fedppl.runtime.flower_wire import content, fields, record_bytes

from . import flower_tasks

# the module's simulations share one Ray cluster (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_ray_cluster")

jax.config.update("jax_enable_x64", True)


def test_a_node_whose_data_do_not_fit_is_named():
    """One node holds three features where the model was set up with two: the set-up fails with
    an error naming the node, before any round."""

    def task(run_config):
        base = flower_tasks.task({"method": "pvi-synchronous"})

        def load(k):
            X, y = base.load_partition(k)
            return (np.hstack([X, X[:, :1]]), y) if k == 1 else (X, y)

        return base._replace(load_partition=load, num_rounds=1)

    with pytest.raises(FlowerError, match="client 1"):
        FlowerApp(task).simulate()


def test_messages_are_checked_against_the_method():
    """A message of the wrong structure, shape or dtype is refused with the sender's name."""
    like = {"a": jax.ShapeDtypeStruct((2,), np.float64), "b": jax.ShapeDtypeStruct((), np.int32)}
    good = {"a": np.ones(2), "b": np.int32(3)}
    out = unpack(pack(good), like, "client 4")
    np.testing.assert_array_equal(out["a"], good["a"])
    with pytest.raises(ValueError, match="client 4 sent a message with 1 arrays, expected 2"):
        unpack(pack({"a": np.ones(2)}), like, "client 4")
    with pytest.raises(ValueError, match=r"client 4 .*array 0 has shape \(3,\)"):
        unpack(pack({"a": np.ones(3), "b": np.int32(3)}), like, "client 4")
    with pytest.raises(ValueError, match="dtype float32"):
        unpack(pack({"a": np.ones(2, np.float32), "b": np.int32(3)}), like, "client 4")
    key = jax.random.key(3)
    back = unpack(pack(key), key)
    assert jax.random.key_data(back).tolist() == jax.random.key_data(key).tolist()


def test_malformed_bytes_are_refused_with_the_senders_name():
    """A message's bytes that are not :func:`pack`'s (a header that does not parse, a dtype
    that is not a number, data shorter or longer than the header says, not bytes at all) are
    refused with the sender's name, never read as arrays."""
    like = {"a": jax.ShapeDtypeStruct((2,), np.float64)}
    good = pack({"a": np.ones(2)})
    header = int.from_bytes(good[:4], "little")
    bad = {"garbage header": b"\x05\x00\x00\x00{not json" + bytes(16),
           "object dtype": _packed('[["|O8", [2]]]', bytes(16)),
           "negative shape": _packed('[["<f8", [-2]]]', b""),
           "truncated": good[:-1], "longer": good + b"\x00",
           "header past the end": (10**6).to_bytes(4, "little") + good[4:]}
    for data in bad.values():  # each named for what is wrong with it
        with pytest.raises(ValueError, match="client 4 sent a message"):
            unpack(data, like, "client 4")
    with pytest.raises(ValueError, match="client 4 sent a message that is not bytes"):
        unpack(None, like, "client 4")
    assert header > 0 and unpack(good, like, "client 4")["a"].tolist() == [1.0, 1.0]


def test_a_message_is_one_record_whatever_its_trees():
    """A message's trees travel in one record: Flower stores it as the content and that record
    (two objects beside the message, each one request through the SuperLink), however many
    trees and leaves it carries; an ArrayRecord per tree would be one object per array more."""
    from flwr.supercore.inflatable.inflatable_object import get_object_tree, iterate_object_tree

    trees = {"server": {"a": np.ones((5, 5)), "b": np.ones(5), "c": np.arange(3)},
             "key": jax.random.key(0), "reply.3": [np.ones(2), np.zeros((2, 2))]}
    c = content({"round": 4, "reply_rounds": [3]}, **trees)
    assert sum(1 for _ in iterate_object_tree(get_object_tree(c))) == 2
    got = fields(c, "the server")
    assert got["round"] == 4 and list(got["reply_rounds"]) == [3]
    back = unpack(got["server"], trees["server"], "the server")
    assert all(np.array_equal(back[k], trees["server"][k]) for k in trees["server"])
    assert record_bytes(c) == sum(len(got[k]) for k in trees)
    with pytest.raises(ValueError, match="client 2 sent a message without fedppl's record"):
        fields(RecordDict(), "client 2")


def _packed(header: str, data: bytes) -> bytes:
    raw = header.encode()
    return len(raw).to_bytes(4, "little") + raw + data


def test_flower_task_needs_enough_nodes():
    """Fewer simulated nodes than the task's clients: a clear error, not a hang."""

    def task(run_config):
        return flower_tasks.task({"method": "pvi-synchronous"})._replace(
            num_clients=3, connect_timeout=3.0)

    app = FlowerApp(task)
    with pytest.raises(FlowerError, match="only 2 of 3 nodes connected within 3 s"):
        app.simulate(num_supernodes=2)
    assert isinstance(app, FlowerApp) and Task is not None


def test_secure_aggregation_sums_the_statistics():
    """SecAgg+ (Flower's secaggplus_mod on every node): the securely aggregated sufficient
    statistics equal their plain sum to the quantisation's bound, and give the same exact
    posterior; a node whose statistics exceed the public scale is refused by name."""
    from fedppl.algorithms import exact
    from fedppl.runtime.secagg import QUANTIZATION, SumTask, secure_sum

    like = jax.eval_shape(lambda: flower_tasks.secagg_statistics(0))
    task = SumTask(flower_tasks.secagg_statistics, like, num_clients=3, scale=1e3)
    secure = secure_sum(task)
    plain = exact.aggregate([flower_tasks.secagg_statistics(k) for k in range(3)])
    bound = 3 * task.scale * 2 / QUANTIZATION
    assert isinstance(secure, exact.Stats)
    for a, b in zip(secure, plain, strict=True):
        assert np.shape(a) == np.shape(b)
        np.testing.assert_allclose(a, np.asarray(b), rtol=0, atol=bound)
    m, _ = exact.g.to_moments(exact.posterior(jax.tree_util.tree_map(jax.numpy.asarray, secure),
                                              1.0, 1.0))
    m0, c0 = exact.g.to_moments(exact.posterior(plain, 1.0, 1.0))
    # to first order, entries of X'X and X'y off by at most `bound` move the mean by at most
    # ||A^-1|| (||d(X'y)|| + ||d(X'X)|| ||m||) (noise and prior scale 1); twice that covers the rest
    dim = len(m0)
    moved = np.linalg.norm(np.asarray(c0), 2) * bound * (np.sqrt(dim) + dim * np.linalg.norm(m0))
    assert np.linalg.norm(np.asarray(m - m0)) <= 2 * moved
    # a node whose statistics exceed the public scale refuses to send them, naming itself
    from fedppl.runtime.secagg import summand_content

    with pytest.raises(ValueError, match=r"partition 1: .* beyond the task's scale"):
        summand_content(flower_tasks.secagg_statistics(1), 1.0, "partition 1")


def test_private_pvi_noise_comes_from_the_node_not_the_server():
    """DP-PVI on the Simulation Engine: every node folds its own secret into the key the server
    sends, so the noise (and the posterior) differ from the embedded run with the same seed,
    whose keys the server knows; the accounting is the same."""
    import fedppl
    from fedppl.models import logistic_regression as model

    rng = np.random.default_rng(0)
    X = rng.normal(size=(90, 2))
    clients = fedppl.partition.homogeneous(X, (X[:, 0] > 0) * 1.0, num_clients=3, seed=0)
    dp = fedppl.DPVirtualParties(clip=1.0, noise_multiplier=1.0, parties=3)

    def make():
        return fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", privacy=dp,
                          local_steps=5, num_particles=2)

    def task(run_config):
        return Task(make(), clients.client, clients.num_clients, num_rounds=2)

    flower = FlowerApp(task).simulate()
    embedded = make().run(jax.random.key(0), clients, 2, progress_bar=False)
    assert flower.privacy == embedded.privacy
    mean, var = flower.mean_and_cov()
    assert np.all(np.isfinite(mean)) and np.all(var > 0)
    assert not np.allclose(mean, embedded.mean_and_cov()[0], rtol=1e-6, atol=1e-9)


# last: the one run on two Ray workers (its cluster is started afresh with those arguments;
# the runs above share one with a single worker, tests/conftest.py)
def test_faults_leave_the_server_as_a_clean_run_without_those_clients():
    """A node that crashes, sends a message of the wrong shape, answers after the round's timeout
    or sends NaN: that round's server update goes on without it, ``rejected`` names it with the
    reason, and the posterior equals an embedded run in which those clients sat those rounds
    out. The straggler's late answer (round 4) is never applied: the node learns so when the
    run ends and keeps its old factor."""
    faults = {(1, 2): "crash", (2, 3): "wrong_shape", (0, 4): "slow",
              (1, 5): partial(corrupt, kind="nan")}

    def task(run_config):
        base = flower_tasks.task({"method": "pvi-synchronous"})
        return base._replace(method=flower_tasks.Absent(base.method, {5: [0]}), num_rounds=5,
                             round_timeout=6.0, fault=lambda k, r: faults.get((k, r)))

    app = FlowerApp(task)
    result = app.simulate(num_workers=2)
    why = {(r, who): reason for r, who, reason in result.rejected
           if not reason.startswith("final acknowledgement")}
    assert "fault injected" in why[(2, "client 1")]
    assert "array" in why[(3, "client 2")] and "expected" in why[(3, "client 2")]
    assert "no answer within 6 s" in why[(4, "client 0")]
    assert (5, "client 1") in why  # NaN: refused by the method's own server
    # a clean run with the same participants (on a loaded machine another answer may be late)
    absent: dict[int, list[int]] = {5: [0]}
    for r, who in why:
        absent.setdefault(r, []).append(int(who.split()[-1]))
    clients, _ = flower_tasks._data("pvi-synchronous")
    clean = flower_tasks.Absent(flower_tasks._method("pvi-synchronous"), absent)
    clean.line_search = "adaptive"  # PVI's default on a deployment
    want = clean.run(jax.random.key(0), clients, 5, progress_bar=False)
    np.testing.assert_allclose(result.q.nat1, want.q.nat1, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(result.q.prec, want.q.prec, rtol=1e-9, atol=1e-10)
