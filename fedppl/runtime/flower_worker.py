"""A warm ClientApp process for a Flower SuperNode: a node's messages all handled in one process.

Flower 1.42's SuperNode hands every message to a fresh ``flwr-clientapp`` process (its SuperExec
starts one per message), which pays for Python's, JAX's and the app's imports, the node's
set-up and the compilation of its step each time. A SuperNode started with ``--isolation
process`` starts no SuperExec: it waits for a process of its operator's to claim its tasks on
its Runtime API. This module is such a process. It claims the SuperNode's ClientApp tasks one
after the other and runs each in itself, so a node imports and compiles once per run, and what
:mod:`fedppl.runtime.flower_node` keeps between messages (the compiled trio, the padded data)
stays in memory; the node's state still travels in Flower's context, as with fresh processes.

Run one beside each SuperNode (the Runtime API is the SuperNode's ``--port``, on 127.0.0.1)::

    flower-supernode --isolation process --port 9094 --superlink SERVER:9091 \\
        --root-certificates ca.crt --node-config "partition-id=0 num-partitions=3"
    python -m fedppl.runtime.flower_worker --runtime-api-address 127.0.0.1:9094 \\
        --jax-cache ~/.cache/fedppl-jax

``--jax-cache`` (or a node config's ``jax-cache-dir``) names JAX's persistent compilation cache,
so a restarted worker, or a second run of the same task, loads its compiled steps from disk.

A worker keeps the modules of the app it loaded: when a task of another app (another FAB)
arrives, it starts itself afresh (``exec``) and hands the new process that task, so an app whose
code changed is never run with its old code. A task that fails is answered with Flower's error
message, as a fresh process's would be, and the worker goes on with the next.

The loop uses Flower's own Runtime API client and its ClientApp process's steps (pull the
task's input, run the app, push the reply and the context); it is written against Flower 1.42
(``constraints.txt`` pins it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import httpx
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.cli.install import install_from_fab
    from flwr.clientapp.client_app import LoadClientAppError
    from flwr.clientapp.utils import get_load_client_app_fn
    from flwr.common.config import get_project_dir
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import (
        AcquireTaskRequest,
        PullAppMessagesRequest,
        PullTaskInputRequest,
        SendTaskHeartbeatRequest,
    )
    from flwr.supercore.constant import TaskType
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output
except ImportError as err:  # pragma: no cover - the extra is installed by make test
    raise ImportError("fedppl.runtime.flower_worker needs Flower: pip install 'fedppl[flower]'"
                      ) from err

from fedppl.runtime.flower_supernode import Rhythm

__all__ = ["Worker", "main"]

log = logging.getLogger("fedppl.flower_worker")


class Worker:
    """Claims the ClientApp tasks of one or more SuperNodes on their Runtime APIs
    (``addresses``, host:port each) and runs them in this process, one at a time.
    ``root_certificates``: the Runtime APIs' CA certificate (PEM file), when the SuperNodes
    serve them over TLS. A site runs one worker for its SuperNode; a simulated deployment on one
    machine may share a worker between several SuperNodes (one JAX runtime, one compilation).
    Between tasks it asks every ``poll`` seconds, each wait 1.3 times longer, up to 0.25 s or
    a tenth of its recent waits for a task (:class:`~fedppl.runtime.flower_supernode.Rhythm`);
    ``lead``: its first claim after a task as a share of those waits (0: at once, the default:
    at K = 10, 0.8 made a round 2.8 s against 1.9 s, its wait added to its SuperNode's)."""

    def __init__(self, addresses: str | Sequence[str], *, root_certificates: str | None = None,
                 poll: float = 0.02, lead: float = 0.0, argv: Sequence[str] = ()):
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        self.poll, self.lead, self.argv = poll, lead, list(argv)
        self.certificates = (None if root_certificates is None
                             else Path(root_certificates).read_bytes())
        self.fab: str | None = None  # the app this process has loaded (its FAB's hash)
        self.apps: dict[str, Any] = {}
        self.handled = 0

    def _client(self, address: str, *interceptors: Any) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(
            server_address=address, insecure=self.certificates is None,
            root_certificates=self.certificates, interceptors=list(interceptors),
            retry_invoker=_retry_invoker())

    def serve(self, max_tasks: int | None = None) -> None:
        """Claim and run tasks until ``max_tasks`` have run (None: until stopped)."""
        claims = {a: self._client(a, RuntimeVersionHttpInterceptor(component_name="SuperExec"))
                  for a in self.addresses}
        wait, rhythm = self.poll, Rhythm(self.lead)
        try:
            while max_tasks is None or self.handled < max_tasks:
                if any([self._claim(address, client) for address, client in claims.items()]):
                    wait = self.poll
                    rhythm.busy(time.monotonic())
                else:  # idle: first when the rounds' rhythm says, then less often
                    ahead = rhythm.idle(time.monotonic())
                    if ahead is not None and ahead > wait:
                        time.sleep(ahead)
                        continue
                    time.sleep(wait)
                    wait = min(rhythm.cap(0.25), 1.3 * wait)
        finally:
            for client in claims.values():
                client.close()

    def _claim(self, address: str, client: RuntimeHttpClient) -> bool:
        """Claim and run one task of the SuperNode at ``address``, if it has one."""
        try:
            res = client.AcquireTask(AcquireTaskRequest(
                supported_task_types=[TaskType.CLIENT_APP]))
        except httpx.TransportError:  # the SuperNode is not up yet, or is gone
            return False
        if not (res.HasField("task") and res.token):
            return False
        if self.fab is not None and res.task.fab_hash != self.fab:
            self._restart(address, res.token)
        self.run_task(address, res.token)
        return True

    def _restart(self, address: str, token: str) -> None:
        """This process afresh (another app's task: its modules must be imported anew), handed
        the claimed task."""
        log.info("a task of another app: restarting the worker")
        os.execv(sys.executable, [sys.executable, "-m", "fedppl.runtime.flower_worker", *self.argv,
                                  "--task", address, token])

    def _app(self, run: Any, fab: Any) -> Any:
        if fab.hash_str not in self.apps:
            if not get_project_dir(run.fab_id, run.fab_version, fab.hash_str).exists():
                install_from_fab(fab.content, skip_prompt=True)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        self.fab = fab.hash_str
        return self.apps[fab.hash_str]

    def run_task(self, address: str, token: str) -> None:
        """One task: pull its message and context, run the ClientApp, push the reply and the
        context (an exception in the app becomes Flower's error reply)."""
        client = self._client(address,
                              RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                              RuntimeTokenHttpInterceptor(token))
        heartbeat = HeartbeatSender(lambda: _beat(client))
        message = reply = context = None
        status, details = SubStatus.FAILED, "the ClientApp task failed"
        times = [time.perf_counter()]  # start, message pulled, app done, reply pushed
        try:
            heartbeat.start()
            message, context, run, fab = _pull_task_input(client)
            times.append(time.perf_counter())
            reply = self._app(run, fab)(message=message, context=context)
            times.append(time.perf_counter())
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # a failed task is answered; the worker goes on
            log.exception("the ClientApp raised")
            code = (ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(ex, LoadClientAppError)
                    else ErrorCode.CLIENT_APP_RAISED_EXCEPTION)
            details = f"{type(ex)}:<'{ex}'>"
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
                push_task_output(client, context, status, details)
            except Exception:  # the SuperNode gave the task up
                log.exception("could not push the task's reply")
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
            self.handled += 1
            times.append(time.perf_counter())
            steps = ", ".join(f"{name} {b - a:.3f} s" for name, a, b in zip(
                ("pull", "app", "push"), times, times[1:], strict=False))  # as far as it got
            log.info("%s message: %s in %.3f s (%s)", getattr(getattr(
                message, "metadata", None), "message_type", "?"), status, times[-1] - times[0],
                steps)


def _pull_task_input(client: RuntimeHttpClient) -> tuple[Any, Any, Any, Any]:
    """The task's message, context, run and FAB, as Flower's ClientApp process pulls them, but
    retrying a part of the message the SuperNode has not stored yet every 0.02 s (Flower waits
    1 s first: the SuperNode offers the task before it has pulled the whole message)."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context, run, fab = (context_from_proto(res.context), run_from_proto(res.run),
                         fab_from_proto(res.fab))
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode offered a task without a message")
    tree, node = pulled.message_object_trees[0], Node(node_id=context.node_id)
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node,
                                                  context.run_id),
        return_type=Message, initial_backoff=0.02, backoff_cap=0.2)
    message.metadata.__dict__["_message_id"] = tree.object_id  # as Flower's process sets it
    return message, context, run, fab


def _retry_invoker() -> Any:
    """Flower's retries for the Runtime API, except that a refused token (HTTP 401) ends the
    request with an error rather than the process: Flower's ClientApp process, which serves one
    task, interrupts itself (SIGINT) there, but this process serves every task of its nodes,
    and its heartbeat for a task can reach the SuperNode just after the task ended (a worker at
    K = 50 stopped that way, and its ten nodes' rounds with it)."""
    invoker = make_simple_http_retry_invoker()
    flowers = invoker.should_giveup

    def should_giveup(exc: Exception) -> bool:
        if isinstance(exc, httpx.HTTPStatusError) \
                and exc.response.status_code == httpx.codes.UNAUTHORIZED:
            return True
        return flowers(exc) if flowers is not None else False

    invoker.should_giveup = should_giveup
    return invoker


def _beat(client: RuntimeHttpClient) -> bool:
    """One heartbeat for the running task (False: not delivered, try again). Unlike Flower's own,
    a refused heartbeat does not stop the process: the task's reply will be refused instead."""
    try:
        client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
    except httpx.HTTPError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m fedppl.runtime.flower_worker",
                                description=__doc__.splitlines()[0])
    p.add_argument("--runtime-api-address", required=True, action="append",
                   help="a SuperNode's Runtime API, host:port (its --port); repeat it to serve "
                        "several SuperNodes")
    p.add_argument("--root-certificates", default=None,
                   help="CA certificate of the Runtime API, if the SuperNode serves it over TLS")
    p.add_argument("--jax-cache", default=None,
                   help="JAX's persistent compilation cache directory")
    p.add_argument("--poll", type=float, default=0.02,
                   help="seconds between task claims after a task (growing to 0.25 s when idle)")
    p.add_argument("--lead", type=float, default=0.0,
                   help="the first claim after a task, as a share of the worker's shortest "
                        "recent wait for one (default 0: at once; its SuperNode already waits "
                        "for the round's rhythm, and a wait here adds to that one)")
    p.add_argument("--preload", nargs="*", default=["fedppl.runtime.flower"],
                   help="modules to import before the first task (default: fedppl's Flower "
                        "runtime, with JAX), so that no message waits for them")
    p.add_argument("--task", nargs=2, default=None, help=argparse.SUPPRESS)  # handed on
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if args.jax_cache:
        from fedppl.runtime.flower_node import use_compilation_cache

        use_compilation_cache(args.jax_cache)
    for module in args.preload:
        importlib.import_module(module)
    keep = list(argv[:argv.index("--task")] + argv[argv.index("--task") + 3:]
                if "--task" in argv else argv)  # what a restart passes on
    worker = Worker(args.runtime_api_address, root_certificates=args.root_certificates,
                    poll=args.poll, lead=args.lead, argv=keep)
    if args.task:
        worker.run_task(*args.task)
    worker.serve()


if __name__ == "__main__":
    main()
