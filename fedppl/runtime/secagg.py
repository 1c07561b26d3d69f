"""Secure aggregation (Flower's SecAgg+) of what a server needs only the sum of (extra
``flower``). The server learns the sum over the nodes and nothing about any one node's part.

Two uses of one protocol:

* inside a method's rounds on Flower: ``Task(..., secure=SecureSum(scale))`` sends each
  exchange of synchronous PVI, FSGP and FedBNR through SecAgg+ (:mod:`fedppl.runtime.flower`;
  how each method's messages enter the sum: :func:`fedppl.runtime.secure.secure_form`);
* once, over statistics each node computes on its own partition: a :class:`SumTask` summed by
  :func:`secure_sum` (Simulation Engine) or :func:`secure_sum_apps` (``flwr run``).

Either way the node's ClientApp carries :func:`secure_mod` (Flower's ``secaggplus_mod`` for the
train messages that ask for it): it masks the node's vector before it leaves; the server runs
Flower's ``SecAggPlusWorkflow`` (:func:`secure_exchange`), adds the masked vectors and removes
the masks of the sum only. No cryptography is written here: this module encodes and checks.

**Quantisation.** SecAgg+ adds integers. A node divides its vector by the public ``scale`` (an
entry beyond it is refused, naming the node, not clipped) and sends each entry ``u`` of
``[-1, 1]`` as two limbs: ``u`` rounded to SecAgg+'s grid of ``2**22`` levels, which its
quantiser then keeps exactly, and the remainder times ``2**22``, which it rounds to the same
grid. The sum over ``n`` nodes is then exact to ``n * scale * 2**-43`` per entry
(:func:`error_bound` allows ``2**-42``, for float round-off), where one limb would give
``n * scale * 2**-21``: with ``scale = 1e3`` and 3 nodes, 7e-10 in place of 1.4e-3, at twice the
bytes. The limbs' sums stay below SecAgg+'s modulus ``2**32`` for up to 1023 nodes.

Example (three nodes' ``X'X`` and ``X'y``; the statistics function must be importable by the
Simulation Engine's workers, as any ClientApp's code)::

    like = exact.Stats(jax.ShapeDtypeStruct((D, D), float), jax.ShapeDtypeStruct((D,), float),
                       jax.ShapeDtypeStruct((), float))
    task = SumTask(mypackage.stats_of_partition, like, num_clients=3, scale=1e3)
    total = secure_sum(task)          # an exact.Stats: the sum over the three nodes
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import jax
import numpy as np

try:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import (
        Code,
        FitIns,
        FitRes,
        Parameters,
        Status,
        bytes_to_ndarray,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server.compat import LegacyContext
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey
    from flwr.serverapp import Grid, ServerApp
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("fedppl.runtime.secagg needs Flower: pip install 'fedppl[flower]'") from err

from fedppl.runtime.flower_wire import flower_log, record_bytes
from fedppl.runtime.secure import SecureSum

__all__ = ["SecureSum", "Summed", "SumTask", "secure_sum", "secure_sum_apps", "secure_exchange",
           "secure_mod", "summand_content", "request", "requested", "error_bound", "size_of",
           "as_tree", "share",
           "QUANTIZATION"]

#: SecAgg+'s quantisation levels over [-1, 1] (each of a value's two limbs is on this grid).
QUANTIZATION = 2**22
_HALF = QUANTIZATION // 2
_REQUEST = "fedppl.secure"  # the config record of a round message that asks for SecAgg+


def error_bound(scale: float, n: int) -> float:
    """The largest error per entry of a sum over ``n`` nodes (two limbs; float round-off
    included).

    >>> error_bound(1e3, 3) < 1e-9
    True
    """
    return float(n) * float(scale) * 2.0**-42


# -- the node's side -------------------------------------------------------------------------


def _flat(summand: Any, scale: float, who: str) -> np.ndarray:
    """The summand's leaves as one float vector, after checking each is finite and within
    ``scale`` (a ``ValueError`` names ``who`` and the leaf)."""
    parts = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(summand)[0]:
        x = np.asarray(leaf, np.float64)
        name = jax.tree_util.keystr(path) or "its value"
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{who}: {name} is not finite; not sent")
        top = float(np.max(np.abs(x), initial=0.0))
        if top > scale:
            raise ValueError(f"{who}: {name} reaches {top:.4g}, beyond the task's scale "
                             f"{scale:g} (SecureSum.scale, public); raise the scale")
        parts.append(x.ravel())
    return np.concatenate(parts) if parts else np.zeros(0)


def _limbs(u: np.ndarray) -> list[np.ndarray]:
    """``u`` in [-1, 1] as two vectors on SecAgg+'s grid (module doc): ``u`` rounded to it,
    and the remainder times ``QUANTIZATION``."""
    high = np.round((u + 1.0) * _HALF) / _HALF - 1.0
    return [high, (u - high) * QUANTIZATION]


def summand_content(summand: Any, scale: float, who: str) -> RecordDict:
    """What a node answers SecAgg+'s masking stage with: ``summand`` (a pytree of float arrays)
    divided by ``scale`` and split into its limbs, as the ``FitRes`` that ``secaggplus_mod``
    reads. A ``ValueError`` names ``who`` when an entry is not finite or exceeds ``scale``."""
    limbs = _limbs(_flat(summand, scale, who) / scale)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(limbs), 1, {})
    return compat.fitres_to_recorddict(fitres, keep_input=True)


def request(content: RecordDict, secure: SecureSum, exchange: str) -> RecordDict:
    """``content`` (a round message's) marked as asking for SecAgg+ (``exchange``: ``"train"``
    or ``"evaluate"``)."""
    content.config_records[_REQUEST] = ConfigRecord({"scale": float(secure.scale),
                                                     "exchange": exchange})
    return content


def requested(content: RecordDict) -> dict[str, Any] | None:
    """What a round message asks of SecAgg+ (``scale``, ``exchange``), or None (a plain one)."""
    if _REQUEST not in content.config_records:
        return None
    return dict(content.config_records[_REQUEST])


def secure_mod(msg: Message, context: Context, call_next: Callable) -> Message:
    """Flower's ``secaggplus_mod`` for a train message that carries SecAgg+'s stage (every
    secure one); any other message goes straight to the ClientApp."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


# -- the server's side -----------------------------------------------------------------------


def size_of(like: Any) -> int:
    """How many entries the leaves of ``like`` (arrays or ``jax.ShapeDtypeStruct``) hold."""
    return int(sum(np.prod(np.shape(x), dtype=int) for x in jax.tree_util.tree_leaves(like)))


def as_tree(flat: np.ndarray, like: Any) -> Any:
    """``flat`` (a sum's entries, in :func:`summand_content`'s order) shaped as ``like``'s
    leaves, in their dtypes (NumPy leaves)."""
    leaves, tree = jax.tree_util.tree_flatten(like)
    parts = np.split(np.asarray(flat), np.cumsum([np.size(x) for x in leaves])[:-1])

    def leaf(part: np.ndarray, x: Any) -> np.ndarray:
        dtype = np.dtype(x.dtype)
        part = np.rint(part) if dtype.kind in "iub" else part  # a count is summed exactly
        return np.reshape(part, np.shape(x)).astype(dtype)

    return jax.tree_util.tree_unflatten(tree, [leaf(p, x) for p, x in zip(parts, leaves,
                                                                          strict=True)])


def share(total: Any, n: int, i: int) -> Any:
    """Part ``i`` of ``n`` parts that add up to ``total`` (a pytree): ``1/n`` of each float
    leaf; integer leaves as evenly as integers go."""

    def part(x: Any) -> Any:
        x = np.asarray(x)
        if x.dtype.kind in "iu":
            q, r = np.divmod(x, n)
            return (q + (i < r)).astype(x.dtype)
        return x / n

    return jax.tree_util.tree_map(part, total)


class Summed(NamedTuple):
    """One secure exchange's outcome: ``total`` (the flat sum, None if SecAgg+ halted), the
    ``nodes`` it covers, why each other node is not in it (``errors``), and the traffic
    (messages up, down, bytes up, down)."""

    total: np.ndarray | None
    nodes: frozenset[int]
    errors: dict[int, str]
    traffic: np.ndarray


Send = Callable[[list[Message], float | None], list[Message]]


def secure_exchange(send: Send, contents: Mapping[int, RecordDict], secure: SecureSum,
                    size: int, *, group: int = 0, timeout: float | None = None) -> Summed:
    """One SecAgg+ run (Flower's ``SecAggPlusWorkflow``) over the nodes ``contents`` names: each
    node gets its content (a round message marked by :func:`request`) with the masking stage
    and answers with :func:`summand_content` of a ``size``-entry vector; returns the sum.
    ``send(messages, timeout)``: the ServerApp's ``grid.send_and_receive``."""
    if len(contents) < 2:
        raise ValueError(f"secure aggregation needs at least 2 nodes, got {len(contents)}")
    watched = _Watched(send, size)
    strategy = _Collect(list(contents))
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                                    run_config={}), strategy=strategy)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: int(group)})
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = _Workflow(contents, num_shares=1.0, reconstruction_threshold=float(secure.threshold),
                         max_weight=1.0, clipping_range=1.0, quantization_range=QUANTIZATION,
                         timeout=timeout)
    with flower_log(lambda record: record.levelno >= logging.WARNING):  # not every stage
        workflow(watched, context)  # type: ignore[arg-type]
    errors = watched.errors
    if strategy.mean is None:
        for nid in contents:
            errors.setdefault(nid, "secure aggregation halted: fewer nodes answered than its "
                                   "threshold")
        return Summed(None, frozenset(), errors, watched.traffic)
    n = len(strategy.nodes)
    high, low = (np.asarray(m, np.float64) * n for m in strategy.mean)
    for nid in set(contents) - strategy.nodes:
        errors.setdefault(nid, "left out of the secure sum")
    return Summed(secure.scale * (high + low / QUANTIZATION), frozenset(strategy.nodes), errors,
                  watched.traffic)


class _Workflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow whose masking stage sends each node its own round message."""

    def __init__(self, contents: Mapping[int, RecordDict], **settings: Any):
        super().__init__(**settings)
        self.contents = contents

    def setup_stage(self, grid, context, state) -> bool:
        ok = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        return ok


class _Collect(FedAvg):
    """The strategy SecAgg+'s workflow asks: every node in ``nodes`` takes part; it keeps the
    unmasked mean of the limbs and which nodes it covers."""

    def __init__(self, nodes: list[int]):
        super().__init__(fraction_evaluate=0.0, min_fit_clients=len(nodes),
                         min_available_clients=len(nodes))
        self.node_ids = nodes
        self.mean: list[np.ndarray] | None = None
        self.nodes: frozenset[int] = frozenset()

    def configure_fit(self, server_round, parameters, client_manager):
        return [(GridClientProxy(nid, None, 0), FitIns(Parameters([], ""), {}))  # type: ignore
                for nid in self.node_ids]

    def aggregate_fit(self, server_round, results, failures):
        if results:  # after unmasking every result carries the same (mean) parameters
            self.nodes = frozenset(proxy.node_id for proxy, _ in results)
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}


class _Watched:
    """The ServerApp's grid as SecAgg+'s workflow uses it, through ``send``: it notes why a node
    drops out (its error, no answer, a masked vector of the wrong shape, which it withholds
    from the workflow so that the node counts as dropped) and counts the traffic."""

    def __init__(self, send: Send, size: int):
        self.send, self.size = send, size
        self.errors: dict[int, str] = {}
        self.traffic = np.zeros(4, np.int64)

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.traffic[[1, 3]] += (len(messages), sum(record_bytes(m.content) for m in messages))
        replies = []
        for m in self.send(messages, timeout):
            nid = m.metadata.src_node_id
            if m.has_error():
                lines = [ln for ln in str(m.error.reason).splitlines() if ln.strip()]
                self.errors.setdefault(nid, f"the node failed: {(lines or ['?'])[-1][-300:]}")
            else:
                self.traffic[[0, 2]] += (1, record_bytes(m.content))
                wrong = self._wrong_shape(m.content)
                if wrong:
                    self.errors.setdefault(nid, wrong)
                    continue
            replies.append(m)
        answered = {m.metadata.src_node_id for m in replies}
        for m in messages:
            if m.metadata.dst_node_id not in answered:
                self.errors.setdefault(m.metadata.dst_node_id, "no answer" + (
                    "" if timeout is None else f" within {timeout:g} s"))
        return replies

    def _wrong_shape(self, content: RecordDict) -> str | None:
        configs = content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is None or Key.MASKED_PARAMETERS not in configs:
            return None
        shapes = [bytes_to_ndarray(b).shape
                  for b in cast(list[bytes], configs[Key.MASKED_PARAMETERS])]
        want = [(1,), (self.size,), (self.size,)]  # SecAgg+'s weight factor, then the limbs
        if shapes != want:
            return f"sent a masked vector of shapes {shapes}, expected {want}"
        return None


# -- one sum over the nodes' statistics ------------------------------------------------------


class SumTask(NamedTuple):
    """``statistics(k)``: partition ``k``'s statistics (a pytree of float arrays, computed on the
    node that holds it); ``like``: their public structure (a pytree of the same shape, arrays or
    ``jax.ShapeDtypeStruct``, for the server to put the sum back into); ``num_clients`` nodes
    take part; ``scale``: a public bound on the statistics' entries."""

    statistics: Callable[[int], Any]
    like: Any
    num_clients: int
    scale: float = 1.0
    timeout: float | None = 120.0


def _statistics(task: SumTask, partition: int) -> Any:
    """Partition ``partition``'s statistics, checked against the task's structure."""
    stats = task.statistics(partition)
    got = [np.shape(x) for x in jax.tree_util.tree_leaves(stats)]
    want = [tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(task.like)]
    if got != want:
        raise ValueError(f"partition {partition}: statistics of shapes {got}, the task expects "
                         f"{want}")
    return stats


def secure_sum_apps(task: SumTask, done: Callable[[Any, int], None] | None = None
                    ) -> tuple[ServerApp, ClientApp]:
    """The ServerApp (one SecAgg+ exchange; ``done(total, count)`` receives the sum, shaped as
    ``task.like``, and how many nodes it covers) and the ClientApp (with :func:`secure_mod`)."""
    size = size_of(task.like)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        deadline = time.monotonic() + (task.timeout or 120.0)
        while len(nodes := sorted(grid.get_node_ids())) < task.num_clients:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(nodes)} of {task.num_clients} nodes connected")
            time.sleep(0.2)
        secure = SecureSum(task.scale, max(2, task.num_clients - 1) / task.num_clients)
        summed = secure_exchange(
            lambda msgs, timeout: list(grid.send_and_receive(msgs, timeout=timeout)),
            {nid: request(RecordDict(), secure, "sum") for nid in nodes}, secure, size,
            timeout=task.timeout)
        if summed.total is None:
            raise RuntimeError(f"secure aggregation did not finish: {summed.errors}")
        if done is not None:
            done(as_tree(summed.total, task.like), len(summed.nodes))

    client_app = ClientApp(mods=[secure_mod])

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        k = int(context.node_config["partition-id"])
        return Message(summand_content(_statistics(task, k), task.scale, f"partition {k}"),
                       reply_to=msg)

    return server_app, client_app


def secure_sum(task: SumTask, *, verbose: bool = False) -> Any:
    """The sum over the ``num_clients`` nodes of their statistics (the structure of
    ``task.like``, NumPy leaves), by SecAgg+ on Flower's Simulation Engine (one node per
    partition)."""
    from flwr.simulation import run_simulation

    out: dict[str, Any] = {}
    server_app, client_app = secure_sum_apps(
        task, lambda total, count: out.update(total=total, count=count))
    run_simulation(server_app, client_app, num_supernodes=task.num_clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 1, "include_dashboard": False,
                                                 "log_to_driver": verbose}},
                   verbose_logging=verbose)
    if "total" not in out:
        raise RuntimeError("secure aggregation did not finish; run with verbose=True to see "
                           "Flower's log")
    if out["count"] != task.num_clients:
        raise RuntimeError(f"secure aggregation covered {out['count']} of {task.num_clients} "
                           "nodes")
    return out["total"]
