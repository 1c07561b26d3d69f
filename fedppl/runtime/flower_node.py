"""A Flower node's side of :mod:`fedppl.runtime.flower`: one ClientApp message's work (set-up,
a round's ``client_update``, an evaluation exchange, the final acknowledgement), with what lasts
between messages kept in Flower's ``context.state``."""

from __future__ import annotations

import inspect
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedppl.algorithms.trio import sent
from fedppl.clients import Clients

try:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.app import ConfigRecord, Context, Message, RecordDict
except ImportError as err:  # pragma: no cover - the extra is installed by make test
    raise ImportError("fedppl.runtime.flower_node needs Flower: pip install 'fedppl[flower]'"
                      ) from err

from fedppl.runtime.embedded import Runtime
from fedppl.runtime.flower_wire import (
    RECORD,
    arrays,
    content,
    fields,
    pack,
    shapes,
    unflatten,
    unpack,
)
from fedppl.runtime.secagg import requested, summand_content
from fedppl.runtime.secure import SecureForm as SecureForm  # where it was defined before
from fedppl.runtime.secure import adds_noise, refusal, secure_form
from fedppl.runtime.task import Task
from fedppl.trees import index


class App(Protocol):
    """What a node reads of its :class:`fedppl.runtime.flower.FlowerApp`: the app's token (one
    per app object: the node's compiled programs are kept per app) and its task for a run's
    configuration."""

    token: str

    def task_for(self, run_config: Mapping[str, Any]) -> Task: ...


# ``run`` arguments that are not ``init``'s (how a run is shown and when it stops)
RUN_ONLY = ("progress_bar", "tol")

# Nodes' compiled trios, kept between messages (a Simulation Engine worker or a long-lived
# ClientApp process handles many).
_BUILT: dict[tuple, Any] = {}


class _Built(NamedTuple):
    """What a node derives once from the task and its own data: the trio (compiled), the
    structures of what the server sends, and its padded data."""

    trio: Any
    client_update: Callable
    acknowledge: Callable
    evaluate: Callable | None
    server: Any  # the broadcast's shapes (as this node's own set-up has them)
    client: Any  # this node's state's
    message: Any  # its message's
    reply: Any  # the server's reply's
    candidate: Any  # an evaluation candidate's (None: no evaluation exchange)
    data: tuple
    mask: Any


class Node:
    """One message's work on a node (a ClientApp may run in a fresh process per message: what
    lasts between messages is in ``context.state``)."""

    def __init__(self, app: App, context: Context, content: RecordDict | None = None):
        self.app, self.context = app, context
        # the server's precision, before this process makes any array (a deployment may start
        # a fresh process for every message)
        x64 = self._meta().get("x64")
        sent: Mapping[str, Any] = ({} if content is None
                                   else content.config_records.get(RECORD, {}))
        x64 = sent.get("x64", x64)
        if x64 is not None:
            jax.config.update("jax_enable_x64", bool(x64))
        cache = context.node_config.get("jax-cache-dir")
        if cache:  # the node's persistent compilation cache (its operator's choice)
            use_compilation_cache(str(cache))
        self.task = app.task_for(dict(context.run_config))
        self.partition = int(context.node_config.get("partition-id", 0))
        if "init" in sent:
            self._start(sent)

    def _arrays(self) -> tuple:
        return tuple(np.asarray(a) for a in self.task.load_partition(self.partition))

    def _built(self, rows: int) -> _Built:
        key = (self.app.token, id(self.task), self.partition, rows)
        if key not in _BUILT:
            _BUILT[key] = self._build(rows)
        return _BUILT[key]

    def _set_up(self, clients: Clients) -> dict[str, Any]:
        """The method's own set-up on ``clients`` (``init``: its plan and initial state, no
        round run): its trio, server state and (stacked) client states."""
        method = self.task.method
        kwargs = {k: v for k, v in dict(self.task.run_kwargs).items() if k not in RUN_ONLY}
        if "num_rounds" in inspect.signature(method.init).parameters:
            kwargs["num_rounds"] = self.task.num_rounds  # the server's planned rounds (FedBNR)

        def no_rounds(trio: Any, schedule: str) -> Callable:  # a node runs no round of its own
            def refuse(*args: Any) -> Any:
                raise RuntimeError("a Flower node runs no round of its own")

            return refuse

        # planned on the server's kind of runtime (one whose server holds no data), so that
        # what a method chooses by the runtime (PVI's line search) gives the server's trio
        state = method.init(jax.random.key(self.task.seed), clients,
                            runtime=Runtime(no_rounds, data_at_server=False,
                                            summed=self.task.secure is not None), **kwargs)
        return {"trio": state.plan.trio, "server": state.server, "clients": state.clients}

    def _build(self, rows: int) -> _Built:
        arrays = self._arrays()
        n = arrays[0].shape[0]
        if n > rows:
            raise ValueError(f"partition {self.partition} has {n} rows, the server set up {rows}")
        # The method's own set-up on this node's data (which checks that they fit the model):
        # the trio and this node's states, as the server's set-up has them.
        clients = Clients.from_list([arrays], pad_to=rows)  # padded as the server set it up
        seen = self._set_up(clients)
        trio, full = seen["trio"], shapes(seen["server"])
        server = shapes(sent(trio, seen["server"]))  # what the server sends (its broadcast)
        client = shapes(index(seen["clients"], 0))
        data, mask = clients.padded(0)
        msg = jax.eval_shape(trio.client_update, server, client, data, mask,
                             jax.random.key(0), jnp.asarray(0))[0]
        candidates: list = []

        def capture(candidate):  # what the server's evaluation exchange sends
            candidates.append(shapes(candidate))
            one = jax.tree_util.tree_map(lambda s: jnp.zeros((1, *s.shape), s.dtype), client)
            return jax.vmap(trio.client_evaluate, (None, 0, 0, 0))(
                candidate, one, tuple(d[None] for d in data), mask[None])

        evaluate = None if trio.client_evaluate is None else capture
        stacked = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((1, *s.shape), s.dtype),
                                         msg)
        reply = jax.eval_shape(
            lambda s, m: trio.server_update(s, m, jnp.zeros(1, int), jnp.ones(1, bool),
                                            jax.random.key(0), evaluate), full, stacked)[1]
        jit = jax.jit if trio.jit else (lambda f: f)
        return _Built(trio, jit(trio.client_update), jit(trio.acknowledge),
                      None if trio.client_evaluate is None else jit(trio.client_evaluate),
                      server, client, msg,
                      jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype),
                                             reply),
                      candidates[0] if candidates else None, data, mask)

    def _meta(self) -> dict[str, Any]:
        state = self.context.state
        return dict(state["fedppl.meta"]) if "fedppl.meta" in state.config_records else {}

    def _save(self, client: Any, meta: dict) -> None:
        self._keep("fedppl.client", client)
        self.context.state["fedppl.meta"] = ConfigRecord(meta)

    def _keep(self, name: str, tree: Any) -> None:
        self.context.state[name] = ConfigRecord({"tree": pack(tree)})

    def _kept(self, name: str) -> bytes:
        return cast(bytes, self.context.state.config_records[name]["tree"])

    def _held(self, name: str, built: _Built) -> Any:
        return unpack(self._kept(name), built.client, "this node", "state")

    def setup(self, msg: Message) -> Message:
        """Describe this node's data (shapes, not values) and keep the server's precision; or
        (the second exchange) take its initial state (done in ``__init__``)."""
        sent = fields(msg.content, "the server")
        if "init" in sent:
            return Message(content({"ok": True}), reply_to=msg)
        x64 = bool(sent["x64"])
        self.context.state["fedppl.meta"] = ConfigRecord({"x64": x64})
        arrays = self._arrays()
        info = ConfigRecord({
            "partition": self.partition, "name": f"client {self.partition}",
            "rows": int(arrays[0].shape[0]),
            "shapes": [",".join(str(d) for d in a.shape[1:]) for a in arrays],
            "dtypes": [str(a.dtype) for a in arrays]})
        return Message(RecordDict({"setup": info}), reply_to=msg)

    def _start(self, sent: Mapping[str, Any]) -> None:
        """This node's initial state, with the first message after the set-up: computed here,
        as the method's set-up computes client ``index``'s from its own data (such as inducing
        inputs drawn from its rows), with a stand-in (every value 1) in the other clients'
        places; the server's record of it, made on a stand-in, is only checked for shapes."""
        k, rows = int(cast(int, sent["index"])), int(cast(int, sent["rows"]))
        built = self._built(rows)
        unpack(sent["init"], built.client, "the server", "client state")
        own = self._arrays()
        data = [tuple(np.ones((rows, *a.shape[1:]), a.dtype) for a in own)
                for _ in range(self.task.num_clients)]
        data[k] = own
        client = index(self._set_up(Clients.from_list(data))["clients"], k)
        self._save(client, {**self._meta(), "index": k, "rows": rows, "pending": -1})

    def _acknowledge(self, built: _Built, sent: Mapping[str, Any], meta: dict) -> Any:
        """This node's state after the server's reply to its pending message (if the server sent
        it; the server's reply to a message that arrived late is its reply to a message it did
        not receive, so the state stays as it was)."""
        client = self._held("fedppl.client", built)
        pending = int(meta["pending"])
        rounds = list(cast(list, sent.get("reply_rounds", [])))
        if pending >= 0 and pending in rounds:
            msg = unflatten(self._kept("fedppl.message"), built.message)
            reply = unflatten(sent[f"reply.{pending}"], built.reply)
            client = built.acknowledge(client, msg, reply, self._held("fedppl.proposed", built))
            meta["pending"] = -1
        return client

    def train(self, msg: Message) -> Message:
        secure = secure_request(self, msg.content)
        if secure is not None and secure["exchange"] == "evaluate":
            return _secure_evaluation(self, msg, float(secure["scale"]))
        asked = fields(msg.content, "the server")
        meta = self._meta()
        built = self._built(int(meta["rows"]))
        client = self._acknowledge(built, asked, meta)
        server = unflatten(asked["server"], built.server)
        key = unpack(asked["key"], jax.random.key(0), "the server", "key")
        if adds_noise(self.task.method):  # noise the server cannot regenerate from its key
            if "secret" not in meta:
                meta["secret"] = secrets.randbits(31)
            key = jax.random.fold_in(key, int(meta["secret"]))
        rnd = int(cast(int, asked["round"]))
        fault = None if self.task.fault is None else self.task.fault(self.partition, rnd)
        if fault == "crash":
            raise RuntimeError(f"fault injected: partition {self.partition} fails in round {rnd}")
        message, proposed = built.client_update(server, client, built.data, built.mask, key,
                                                jnp.asarray(int(meta["index"])))
        if secure is not None:  # what it keeps is what it sends (PVI: clipped)
            message = _secure_prepared(self, server, message)
        self._keep("fedppl.message", message)
        self._keep("fedppl.proposed", proposed)
        meta["pending"] = rnd
        self._save(client, meta)
        sent: Any = message
        if callable(fault):
            sent = fault(message)
        elif fault == "slow":
            time.sleep(2.0 * (self.task.round_timeout or 1.0) + 1.0)
        elif fault is not None and fault != "wrong_shape":
            raise ValueError(f"unknown fault {fault!r}")
        if secure is not None:  # only the summand leaves, masked (SecAgg+)
            sent = _secure_summand(self, server, sent, float(secure["scale"]))
        if fault == "wrong_shape":
            sent = [*jax.tree_util.tree_leaves(sent), np.zeros(3)]
        if secure is not None:
            return Message(summand_content(sent, float(secure["scale"]),
                                           f"partition {self.partition}"),
                           reply_to=msg)
        return Message(content(message=sent), reply_to=msg)

    def evaluate(self, msg: Message) -> Message:
        meta = self._meta()
        built = self._built(int(meta["rows"]))
        if built.evaluate is None:
            raise ValueError("this method has no evaluation exchange")
        held = "fedppl.proposed" if int(meta["pending"]) >= 0 else "fedppl.client"
        like = built.candidate
        candidate = unflatten(fields(msg.content, "the server")["candidate"], like)
        batched = (jnp.ndim(jax.tree_util.tree_leaves(candidate)[0])
                   > len(jax.tree_util.tree_leaves(like)[0].shape))
        client = self._held(held, built)
        if batched:  # several candidates at once (the server's batched line search)
            value = jax.vmap(built.evaluate, (0, None, None, None))(candidate, client,
                                                                   built.data, built.mask)
        else:
            value = built.evaluate(candidate, client, built.data, built.mask)
        return Message(content(value=value), reply_to=msg)

    def finish(self, msg: Message) -> Message:
        meta = self._meta()
        built = self._built(int(meta["rows"]))
        self._save(self._acknowledge(built, fields(msg.content, "the server"), meta), meta)
        return Message(content({"ok": True}), reply_to=msg)


def use_compilation_cache(path: str | os.PathLike) -> None:
    """JAX's persistent compilation cache in ``path`` for this process, every compiled program
    kept (JAX's default keeps only those that took a second or more to compile; a node's steps
    take less), so a restarted node, or a second run of the same task, loads its steps."""
    os.makedirs(path, exist_ok=True)
    if getattr(jax.config, "jax_compilation_cache_dir", None) != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# -- secure aggregation (fedppl.runtime.secagg): the node's side ------------------------------


_SUMMANDS: dict[Callable, Callable] = {}


def _compiled(fn: Callable) -> Callable:
    if fn not in _SUMMANDS:
        _SUMMANDS[fn] = jax.jit(fn)
    return _SUMMANDS[fn]


def _secure_prepared(node: Node, server: Any, message: Any) -> Any:
    """The message as the node keeps and sends it under secure aggregation (PVI: its delta
    clipped to the norm bound; :class:`~fedppl.runtime.secure.SecureForm`)."""
    form = secure_form(node.task.method, message, node.task.secure)
    return message if form.prepare is None else _compiled(form.prepare)(server, message)


def _secure_summand(node: Node, server: Any, message: Any, scale: float) -> Any:
    """What the node adds into the secure sum in place of its message; raises (naming the node)
    where the server would refuse the message, which the server cannot see."""
    form = secure_form(node.task.method, message, node.task.secure)
    summand, ok = _compiled(form.summand)(server, message)
    why = refusal(form, ok)
    if why is not None:
        raise ValueError(f"partition {node.partition}: {why}; under secure aggregation the "
                         "node withholds its message")
    return summand


def secure_request(node: Node, content: RecordDict) -> dict[str, Any] | None:
    """What a train message asks of SecAgg+ (None: a plain one). A node whose task aggregates
    securely refuses a plain message, and one whose scale is not its task's."""
    asked, secure = requested(content), node.task.secure
    if secure is not None and asked is None:
        raise ValueError(f"partition {node.partition}: the task aggregates securely "
                         "(Task.secure); the server asked for a message in the clear, which "
                         "this node does not send")
    if secure is not None and asked is not None and float(asked["scale"]) != secure.scale:
        raise ValueError(f"partition {node.partition}: the server asked for scale "
                         f"{asked['scale']}, the task's is {secure.scale}")
    return asked


def _secure_evaluation(node: Node, msg: Message, scale: float) -> Message:
    """An evaluation exchange through SecAgg+: the node's value (its statistics under the
    candidate, FedBNR's) enters the sum, after the server's check of it (finite)."""
    value = arrays(fields(node.evaluate(msg).content)["value"])
    return Message(summand_content(value, scale, f"partition {node.partition}"), reply_to=msg)
