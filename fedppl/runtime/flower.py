"""The Flower runtime: any fedppl method on Flower's Simulation or Deployment Engine.

:class:`FlowerApp` turns a :class:`Task` (a method, how a node loads its partition, the rounds
and the seed) into a Flower ``ServerApp`` and ``ClientApp`` that drive the method's
:class:`~fedppl.algorithms.trio.Trio`, as the embedded runtime does, with nothing
method-specific:

* **set-up** (one ``query.setup`` exchange): each node loads its partition and reports its name,
  its number of rows and its arrays' shapes and dtypes (no values). The server runs the method's
  own ``init`` on a stand-in for the clients with those shapes, every value 1 (so a set-up that
  reads data values, such as FSGP's ``init_inducing="client-data"``, is refused: the server
  holds no data), and sends each node its initial client state. Each node builds the same trio
  from its own data, which also checks that its data fit the model (an error names the node);
* **a round** (``train``): the server sends each taking-part node its broadcast (the server
  state), its key (the keys :meth:`~fedppl.infer.base.FederatedMethod.update` would use, so the
  answer is the embedded runtime's) and the server's reply to its previous message; the node
  applies that reply (``acknowledge``), runs ``client_update`` on its own data and state, keeps
  the proposed state in its Flower context, and sends back only the message. A method that adds
  privacy noise at its clients (``privacy=``) has each node fold its own secret, drawn once from
  the operating system and kept in its context, into that key, so the server that sent the key
  cannot regenerate the noise (its runs are then not the embedded runtime's to the bit).
  The round is the embedded runtime's own (:func:`~fedppl.runtime.embedded.make_round` with the
  nodes as its :class:`~fedppl.runtime.embedded.ClientMap`, in place of ``vmap``): synchronous
  rounds send to every node at once; sequential rounds one node at a time, the server updating
  after each. A server that scores candidates on the clients' data (FedBNR's
  evaluation, PVI's line search) asks them in ``evaluate`` exchanges from inside ``server_update``;
* **faults**: a node that does not answer within ``round_timeout`` seconds, answers with an
  error, or sends a message of the wrong structure, shape or dtype takes no part in that round's
  ``server_update`` (``received`` is False for it), and ``result.rejected`` records the round,
  the node and the reason. The method's own server rejects implausible content. A late answer
  is never read: Flower keeps it until its time-to-live and the server does not pull it; the
  node learns at its next contact that its update was not applied (the server's reply for a
  client that was not received) and keeps its old state.

The server keeps its record of each client's state by applying its replies to the client's
messages; what a client never sends (local latent variables) stays with the client.

Example (Bayesian linear regression on 3 simulated nodes; ``tests/runtime`` runs the same)::

    import numpy as np, fedppl
    from fedppl.models import linear_regression
    from fedppl.runtime.flower import FlowerApp, Task

    rng = np.random.default_rng(0)
    X = rng.normal(size=(90, 2))
    clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)

    def task(run_config):  # runs on the server and on every node
        pvi = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression))
        return Task(pvi, clients.client, clients.num_clients, num_rounds=2)

    result = FlowerApp(task).simulate()  # Flower's Simulation Engine
    result.history["messages_up"]        # [3, 3]
"""

from __future__ import annotations

import importlib
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedppl.clients import Clients

try:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.app import Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError as err:  # pragma: no cover - the extra is installed by make test
    raise ImportError("fedppl.runtime.flower needs Flower: pip install 'fedppl[flower]'") from err

from fedppl.runtime.embedded import ClientMap, Runtime, host_map, make_round
from fedppl.runtime.flower_node import Node, secure_request
from fedppl.runtime.flower_wire import (
    content,
    fields,
    flower_log,
    is_key,
    pack,
    quick_object_pulls,
    record_bytes,
    send_and_receive,
    unpack,
)
from fedppl.runtime.secagg import (
    as_tree,
    request,
    secure_exchange,
    secure_mod,
    share,
    size_of,
)
from fedppl.runtime.secure import refusal, secure_form
from fedppl.runtime.task import Task
from fedppl.trees import index, stack, zeros

__all__ = ["Task", "FlowerApp", "FlowerError", "task_from_config", "pack", "unpack"]


class FlowerError(RuntimeError):
    """A deployment that cannot go on (too few nodes, a set-up a node refused)."""


def task_from_config(run_config: Mapping[str, Any]) -> Task:
    """The task that ``run_config["task"]`` (``"package.module:function"``) builds from the run
    config: how a Flower app's pyproject.toml picks its fedppl task (``examples/flower``)."""
    spec = str(run_config.get("task", ""))
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"run config 'task' must be 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(module), name)(run_config)


# Programs this process has compiled (lowered, whether XLA then compiled them or loaded them from
# the persistent cache): a round's count goes into the history as ``server_compiles``.
_COMPILED = [0]


def _count_compile(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _COMPILED[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)

# A process's tasks, kept between messages (a Simulation Engine worker or a long-lived ClientApp
# process handles many).
_TASKS: dict[tuple, Task] = {}


# -- the app ---------------------------------------------------------------------------------------


class FlowerApp:
    """A Flower ``ServerApp`` and ``ClientApp`` from ``task(run_config) -> Task``.

    ``task`` runs on the server and on every node with the run's config (``flwr run -c``); it
    must build the same method everywhere. :meth:`simulate` runs the app on Flower's Simulation
    Engine in this process and returns the method's result; on the Deployment Engine
    (``flwr run``), the ServerApp writes ``result.json`` and the server state (``state.npz``) to
    the run config's ``result-dir``, when given.
    """

    def __init__(self, task: Callable[[Mapping[str, Any]], Task]):
        self.task = task
        # names this app's entries in a process's caches (a copy Ray unpickles keeps it)
        self.token = uuid.uuid4().hex
        self.result: Any = None
        self.server_state: Any = None
        self.fixed_config: dict[str, Any] | None = None  # simulate's run config, for the nodes

    def task_for(self, run_config: Mapping[str, Any]) -> Task:
        """The task for this run config, built once per process (the server and each node)."""
        if self.fixed_config is not None:
            run_config = self.fixed_config
        key = (self.token, tuple(sorted((k, repr(v)) for k, v in run_config.items())))
        if key not in _TASKS:
            _TASKS[key] = self.task(run_config)
        return _TASKS[key]

    def server_app(self) -> ServerApp:
        app = ServerApp()

        @app.main()
        def main(grid: Grid, context: Context) -> None:
            run_config = dict(context.run_config)
            quick_object_pulls(grid)
            server = _Server(grid, self.task(run_config))
            self.result = server.run()
            self.server_state = server.server_state
            out = run_config.get("result-dir")
            if out:
                os.makedirs(str(out), exist_ok=True)
                self.result.to_json(os.path.join(str(out), "result.json"))
                leaves = jax.tree_util.tree_leaves(self.server_state)
                np.savez(os.path.join(str(out), "state.npz"),
                         *[np.asarray(jax.random.key_data(x) if is_key(x) else x)
                           for x in leaves])

        return app

    def client_app(self) -> ClientApp:
        app = ClientApp()

        @app.query("setup")
        def setup(msg: Message, context: Context) -> Message:
            return Node(self, context, msg.content).setup(msg)

        # a secure round's train messages carry SecAgg+'s stages (Task.secure): the mod masks
        @app.train(mods=[secure_mod])
        def train(msg: Message, context: Context) -> Message:
            return Node(self, context, msg.content).train(msg)

        @app.evaluate()
        def evaluate(msg: Message, context: Context) -> Message:
            node = Node(self, context, msg.content)
            secure_request(node, msg.content)  # a secure task's node refuses to answer in clear
            return node.evaluate(msg)

        @app.query("finish")
        def finish(msg: Message, context: Context) -> Message:
            return Node(self, context, msg.content).finish(msg)

        return app

    def simulate(self, run_config: Mapping[str, Any] | None = None, *,
                 num_supernodes: int | None = None, num_workers: int = 1,
                 verbose: bool = False) -> Any:
        """Run on Flower's Simulation Engine (Ray; the ServerApp in this process, the ClientApps
        in ``num_workers`` Ray workers) with ``run_config``; returns the method's result (and
        keeps the last server state as ``self.server_state``)."""
        from flwr.simulation import run_simulation

        run_config = dict(run_config or {})
        task = self.task(run_config)
        self.result, self.fixed_config = None, run_config
        n = task.num_clients if num_supernodes is None else num_supernodes
        server_app = ServerApp()

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            server = _Server(grid, task)
            self.result = server.run()
            self.server_state = server.server_state

        # Flower 1.42 deprecates the Python run_simulation in favour of flwr run; it is kept
        # because it runs the ServerApp in this process, so that the result can be returned
        with flower_log(lambda r: not ("DEPRECATED FEATURE" in r.getMessage()
                                       and "run_simulation" in r.getMessage())):
            run_simulation(server_app, self.client_app(), num_supernodes=n,
                           backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                           "init_args": {"num_cpus": int(num_workers),
                                                         "include_dashboard": False,
                                                         "log_to_driver": verbose}},
                           verbose_logging=verbose)
        self.fixed_config = None
        if self.result is None:
            raise FlowerError("the simulated ServerApp did not finish; run with verbose=True "
                              "to see Flower's log")
        return self.result


# -- the server ------------------------------------------------------------------------------------


class _Server:
    """The ServerApp's work for one run: set-up, then the method's own ``run`` with its rounds
    sent over Flower (``run(..., runtime=...)``: a runtime whose server holds no data)."""

    def __init__(self, grid: Grid, task: Task):
        self.grid, self.task = grid, task
        self.faults: list[tuple[int, str, str]] = []
        self.round = 0
        self.traffic = np.zeros(4, np.int64)  # messages up, down, bytes up, down
        # the replies each client has not yet confirmed (by answering a later round)
        self.pending: dict[int, list[tuple[int, Any]]] = {}
        self.wire: list[np.ndarray] = []
        self.compiles: list[int] = []  # programs the server compiled in each round

    # one exchange with some clients: client k -> its answer, or why there is none
    def _exchange(self, contents: dict[int, RecordDict], message_type: str,
                  timeout: float | None) -> dict[int, RecordDict | str]:
        out = []
        for k, c in contents.items():
            out.append(Message(c, dst_node_id=self.node_of[k], message_type=message_type,
                               group_id=str(self.round)))
            self.traffic[[1, 3]] += (1, record_bytes(c))
        by_node = {v: k for k, v in self.node_of.items()}
        answers: dict[int, RecordDict | str] = {}
        for m in send_and_receive(self.grid, out, timeout):
            who = by_node.get(m.metadata.src_node_id)
            if who is None or who not in contents:
                continue
            if m.has_error():
                lines = [ln for ln in str(m.error.reason).splitlines() if ln.strip()]
                answers[who] = f"the node failed: {(lines or ['?'])[-1][-300:]}"
            else:
                answers[who] = m.content
                self.traffic[[0, 2]] += (1, record_bytes(m.content))
        for k in contents:
            answers.setdefault(k, "no answer" + ("" if timeout is None else
                                                 f" within {timeout:g} s"))
        return answers

    def _describe(self) -> Clients:
        """Wait for the nodes, learn which partition each holds and its shapes; the stand-in
        for the clients' data (every value 1) that the server's set-up runs on."""
        K, wait = self.task.num_clients, self.task.connect_timeout
        deadline = time.monotonic() + wait
        while len(nodes := sorted(self.grid.get_node_ids())) < K:
            if time.monotonic() > deadline:
                raise FlowerError(f"only {len(nodes)} of {K} nodes connected within {wait:g} s")
            time.sleep(0.2)
        self.node_of = dict(enumerate(nodes))  # until each says which partition it holds
        held: dict[int, tuple[int, dict]] = {}
        x64 = content({"x64": bool(jax.config.read("jax_enable_x64"))})
        for k, a in self._exchange({k: x64 for k in self.node_of}, "query.setup",
                                   120.0).items():
            if isinstance(a, str):
                raise FlowerError(f"node {self.node_of[k]} could not describe its data: {a}")
            info: dict[str, Any] = dict(a.config_records["setup"])
            held[int(info["partition"])] = (self.node_of[k], info)
        missing = sorted(set(range(K)) - set(held))
        if missing:
            raise FlowerError(f"no node holds partitions {missing} (the nodes hold "
                              f"{sorted(held)})")
        self.node_of = {k: held[k][0] for k in range(K)}
        data, names = [], []
        for k in range(K):
            info = held[k][1]
            shapes = [tuple(int(d) for d in s.split(",") if d) for s in info["shapes"]]
            data.append(tuple(np.ones((int(info["rows"]), *shape), dtype=np.dtype(t))
                              for shape, t in zip(shapes, info["dtypes"], strict=True)))
            names.append(str(info["name"]))
        self.names = names
        try:
            return Clients.from_list(data, names=names)
        except (ValueError, TypeError) as err:
            raise FlowerError(f"the nodes' data do not fit together: {err}") from err

    def run(self) -> Any:
        stand_in = self._describe()
        method, task = self.task.method, self.task
        # the method's own progress bar (its run's; off with run_kwargs={"progress_bar": False})
        kwargs = {"progress_bar": True, **dict(task.run_kwargs)}
        # the method's own run, its rounds sent over Flower (the method is not changed)
        result = method.run(jax.random.key(task.seed), stand_in, task.num_rounds,
                            runtime=self._runtime(stand_in), **kwargs)
        self._finish()
        # what crossed the wire each round (the method's own counts are in the history)
        wire = np.asarray(self.wire[:result.num_rounds]).reshape(-1, 4)
        if len(wire) == result.num_rounds:
            result.history.update({"wire_bytes_up": wire[:, 2], "wire_bytes_down": wire[:, 3],
                                   "server_compiles": np.asarray(self.compiles)})
        # a fault's own reason replaces the method's "not accepted" for the same client
        faulted = {(r, who) for r, who, _ in self.faults}
        result.rejected[:] = sorted(
            [r for r in result.rejected if (r[0], r[1]) not in faulted] + self.faults,
            key=lambda r: (r[0], self.names.index(r[1]) if r[1] in self.names else -1))
        return result

    def _who(self, k: int) -> str:
        return f"{self.names[k]} (node {self.node_of[k]})"

    def _runtime(self, stand_in: Clients) -> Runtime:
        """The runtime whose rounds are :func:`~fedppl.runtime.embedded.make_round`'s, their
        clients reached over Flower (:meth:`_clients`), with what this server keeps between
        rounds around each: the set-up of the nodes, the replies they have not confirmed, what
        crossed the wire."""
        rows = stand_in.max_size

        def runtime(trio: Any, schedule: str) -> Callable:
            # the "loop" schedule is the synchronous one: the nodes are the loop
            inner = make_round(trio, "sequential" if schedule == "sequential" else "synchronous",
                               self._clients())

            def round_fn(server, clients, data, masks, keys, active, server_key):
                if self.round == 0:
                    self._start(clients, rows)
                self.round += 1
                before, compiled = self.traffic.copy(), _COMPILED[0]
                server, clients, msgs, replies = inner(server, clients, data, masks, keys, active,
                                                       server_key)
                self.compiles.append(_COMPILED[0] - compiled)
                for k in np.nonzero(np.asarray(active))[0]:
                    self.pending.setdefault(int(k), []).append((self.round, index(replies, k)))
                self.server_state = server
                self.wire.append(self.traffic - before)
                return server, clients, msgs, replies

            return round_fn

        # the server holds stand-ins; under SecAgg+ it gets only each round's sum
        return Runtime(runtime, data_at_server=False, summed=self.task.secure is not None)

    def _clients(self) -> ClientMap:
        """The clients as a round reaches them here: a ``train`` exchange for the clients'
        steps, an ``evaluate`` exchange for the server's scores. The proposed states stay on the
        nodes: the server's record of each client stands for it, so that the record becomes the
        client's state with the server's replies applied (what the server never sees, such as a
        private guide, stays as it was)."""

        found: dict[str, Any] = {}

        def message_like(trio, server, client, data, mask, key):
            # a run's shapes do not change between rounds: traced once, not once per client
            if "like" not in found:
                found["like"] = _message_like(trio, server, client, data, mask, key)
            return found["like"]

        def update(trio, server, clients, data, masks, keys, idx, active):
            K = len(active)
            like = message_like(trio, server, *_one_shape((clients, data, masks, keys)))
            got = self._train(server, {k: keys[k] for k in range(K) if active[k]}, like)
            blank = zeros(like)
            return (stack([got.get(k, blank) for k in range(K)]), clients,
                    jnp.asarray([k in got for k in range(K)]))

        def step(trio, server, client, data, mask, key, k):
            like = message_like(trio, server, client, data, mask, key)
            got = self._train(server, {int(k): key}, like)
            return got.get(int(k), zeros(like)), client, int(k) in got

        return host_map(update, step, self._evaluator if self.task.secure is None
                        else self._secure_evaluator)

    def _start(self, clients: Any, rows: int) -> None:
        """The second set-up exchange: each node's initial state (the node builds and compiles
        its step here, outside any round's timeout)."""
        contents = {k: content({"index": k, "rows": rows}, init=index(clients, k))
                    for k in self.node_of}
        for k, a in self._exchange(contents, "query.setup", 600.0).items():
            if isinstance(a, str):
                raise FlowerError(f"{self._who(k)} could not set up: {a}")

    def _train(self, server: Any, keys: dict[int, Any], like: Any) -> dict[int, Any]:
        """One ``train`` exchange with the clients ``keys`` names (each sent its key): the
        messages that arrived and passed the checks (``Task.secure``: :meth:`_secure_train`)."""
        broadcast = pack(server)  # the same bytes to every node
        contents = {k: content({**self._replies(k), "round": int(self.round),
                                "server": broadcast, "key": pack(keys[k])})
                    for k in sorted(keys)}
        if self.task.secure is not None:
            return self._secure_train(server, contents, like)
        msgs = {}
        for k, a in self._exchange(contents, "train", self.task.round_timeout).items():
            if not isinstance(a, str):  # it answered: it has applied every reply it was sent
                self.pending.pop(k, None)
            try:
                if isinstance(a, str):
                    raise ValueError(a)
                msgs[k] = unpack(fields(a, self._who(k)).get("message"), like, self._who(k))
            except (ValueError, KeyError) as err:
                self.faults.append((self.round, self.names[k], str(err)))
        return msgs

    def _secure_train(self, server: Any, contents: dict[int, RecordDict], like: Any
                      ) -> dict[int, Any]:
        """A ``train`` exchange through SecAgg+: the server gets only the sum of the clients'
        summands (their messages in the method's :class:`~fedppl.runtime.secure.SecureForm`)
        and gives each client the sum covers the same message, one of ``n`` that the method's
        server update folds as it folds theirs."""
        form = secure_form(self.task.method, like, self.task.secure)
        if len(contents) < 2:
            raise FlowerError(f"secure aggregation sums the messages of 2 or more clients; this "
                              f"round asks {len(contents)} (a sequential schedule?)")
        got = self._secure_sum({k: request(c, self.task.secure, "train")
                                for k, c in contents.items()}, like)
        for k in got:  # it answered: it has applied every reply it was sent
            self.pending.pop(k, None)
        if not got:
            return {}
        total = jax.tree_util.tree_map(jnp.asarray, as_tree(got[min(got)], like))
        why = None if form.total_check is None else refusal(
            form, form.total_check(server, total, len(got)))
        if why is not None:  # the total fails the server's check: no client's part is folded
            self.faults.extend((self.round, self.names[k], why) for k in sorted(got))
            return {}
        one = form.message(server, total, len(got))
        return {k: one for k in got}

    def _secure_sum(self, contents: dict[int, RecordDict], like: Any) -> dict[int, np.ndarray]:
        """One SecAgg+ exchange with the clients ``contents`` names: the flat sum, keyed by each
        client it covers (a node that drops out is recorded in ``faults``)."""
        summed = secure_exchange(lambda msgs, timeout: send_and_receive(self.grid, msgs, timeout),
                                 {self.node_of[k]: c for k, c in contents.items()},
                                 self.task.secure, size_of(like), group=self.round,
                                 timeout=self.task.round_timeout)
        self.traffic += summed.traffic
        by_node = {v: k for k, v in self.node_of.items()}
        for node, why in sorted(summed.errors.items()):
            self.faults.append((self.round, self.names[by_node[node]], why))
        return {by_node[node]: summed.total for node in sorted(summed.nodes)
                if summed.total is not None}

    def _secure_evaluator(self, trio: Any, proposed: Any, data: Any, masks: Any
                          ) -> Callable | None:
        """:meth:`_evaluator` through SecAgg+ (``Task.secure``): each client that the sum covers
        gets ``1/n`` of it (so the clients' values add up to the total), the others NaN (as an
        evaluation a client missed)."""
        if trio.client_evaluate is None:
            return None
        K = masks.shape[0]

        def evaluate(candidate):
            one = jax.eval_shape(trio.client_evaluate, candidate,
                                 *_one_shape((proposed, data, masks)))

            def exchange(candidate):
                got = self._secure_sum({k: request(content({"round": self.round},
                                                           candidate=candidate),
                                                   self.task.secure, "evaluate")
                                        for k in range(K)}, one)
                covered = sorted(got)
                missed = jax.tree_util.tree_map(  # as an evaluation a client missed
                    lambda s: np.full(s.shape, np.nan if s.dtype.kind == "f" else 0, s.dtype), one)
                rows = [share(as_tree(got[k], one), len(got), covered.index(k)) if k in got
                        else missed for k in range(K)]
                return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *rows)

            like = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((K, *s.shape), s.dtype),
                                          one)
            return jax.pure_callback(exchange, like, candidate)

        return evaluate

    def _replies(self, k: int) -> dict[str, Any]:
        """The server's replies to client k's messages that it has not confirmed (fields of a
        message's record): it applies the one to the message it last sent (a node that failed
        mid-round may still hold an older one) and drops the others."""
        pending = self.pending.get(k, [])
        return {"reply_rounds": [r for r, _ in pending],
                **{f"reply.{r}": pack(reply) for r, reply in pending}}

    def _evaluator(self, trio: Any, proposed: Any, data: Any, masks: Any) -> Callable | None:
        """``evaluate(candidate) -> (K, ...)`` by an ``evaluate`` exchange (a host callback
        inside the compiled server update); the arguments give only shapes (each node scores
        the candidate on its own data and state)."""
        if trio.client_evaluate is None:
            return None
        K = masks.shape[0]

        def evaluate(candidate):
            one = jax.eval_shape(trio.client_evaluate, candidate,
                                 *_one_shape((proposed, data, masks)))
            ndim = jnp.ndim(jax.tree_util.tree_leaves(candidate)[0])

            def exchange(candidate):
                # under vmap (PVI's line search scores its candidates in one batch) the
                # candidates come stacked on a leading axis: one exchange for all of them
                batch = (np.shape(jax.tree_util.tree_leaves(candidate)[0])[0]
                         if np.ndim(jax.tree_util.tree_leaves(candidate)[0]) > ndim else None)
                want = one if batch is None else jax.tree_util.tree_map(
                    lambda s: jax.ShapeDtypeStruct((batch, *s.shape), s.dtype), one)
                answers = self._exchange({k: content(candidate=candidate) for k in range(K)},
                                         "evaluate", self.task.round_timeout)
                rows = []
                for k in range(K):
                    try:
                        a = answers[k]
                        if isinstance(a, str):
                            raise ValueError(a)
                        rows.append(unpack(fields(a, self._who(k)).get("value"), want,
                                           self._who(k), "evaluation"))
                    except (ValueError, KeyError) as err:
                        self.faults.append((self.round, self.names[k], str(err)))
                        rows.append(jax.tree_util.tree_map(
                            lambda s: np.full(s.shape, np.nan, s.dtype), want))
                axis = 0 if batch is None else 1  # clients after the batch axis
                return jax.tree_util.tree_map(lambda *xs: np.stack(xs, axis=axis), *rows)

            like = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((K, *s.shape), s.dtype),
                                          one)
            return jax.pure_callback(exchange, like, candidate, vmap_method="expand_dims")

        return evaluate

    def _finish(self) -> None:
        """Send every node the reply to its last message, so that its state is final."""
        contents = {k: content(self._replies(k)) for k in sorted(self.pending)}
        self.pending.clear()
        if contents:
            wait = self.task.round_timeout or 60.0
            for k, a in self._exchange(contents, "query.finish", wait).items():
                if isinstance(a, str):
                    self.faults.append((self.round, self.names[k],
                                        f"final acknowledgement not delivered: {a}"))


def _one_shape(tree: Any) -> Any:
    """One client's shapes and dtypes in a tree stacked on the client axis."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def _message_like(trio: Any, server: Any, client: Any, data: Any, mask: Any, key: Any) -> Any:
    """The shapes and dtypes of a client's message (what an answer must match)."""
    return jax.eval_shape(trio.client_update, server, client, data, mask, key,
                          jnp.asarray(0))[0]



# The ServerApp and ClientApp of any Flower app whose run config names its task
# (``task = "package.module:function"``): a pyproject.toml's [tool.flwr.app.components] can point
# at ``fedppl.runtime.flower:server_app`` and ``fedppl.runtime.flower:client_app``.
_BY_CONFIG = FlowerApp(task_from_config)
server_app = _BY_CONFIG.server_app()
client_app = _BY_CONFIG.client_app()
