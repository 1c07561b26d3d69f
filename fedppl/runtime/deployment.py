"""Flower's Deployment Engine on this machine: a SuperLink and K SuperNodes as processes on
127.0.0.1, and ``flwr run`` against them (for tests, benchmarks and ``fedppl demo --runtime
flower-deployment``).

Each process runs from this Python environment (so the ServerApp and ClientApps import fedppl),
in its own process group, with its own ``FLWR_HOME`` in a temporary folder; leaving the ``with``
block stops every process (SIGTERM, then SIGKILL) and removes the folder. Flower 1.42 serves
the SuperLink's Fleet, Control and runtime APIs on one HTTP port. By default
(``isolation="process"``) each SuperNode runs with ``--isolation process`` beside a warm
ClientApp process of its own (:mod:`fedppl.runtime.flower_worker`), which imports JAX and
fedppl and compiles the node's step once per run; ``isolation="subprocess"`` is Flower's
default, a fresh ``flwr-clientapp`` process for every message. The SuperNodes are forks of one
process that imported Flower once (``fork=True``, the default where the platform can fork).
Either way a ClientApp's state lives in its Flower context (``fedppl.runtime.flower`` keeps it
there), and every process shares one JAX persistent compilation cache (``jax_cache``, a
temporary folder unless given), so that only the first compiles.

Across real machines the same processes run with TLS instead of ``--insecure``:
``examples/flower/README.md`` gives the commands (certificates, a SuperLink, SuperNodes each
beside its worker, ``flwr run``), and ``examples/flower/run_localhost.sh`` runs them.

Example (``tests/runtime/test_flower_deployment.py`` runs it)::

    with LocalDeployment(2) as fed:       # a SuperLink and two SuperNodes
        fed.run("examples/flower", {"num-clients": 2, "num-rounds": 1})
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

try:
    import flwr  # noqa: F401
except ImportError as err:  # pragma: no cover - the extra is installed by make test
    raise ImportError("fedppl.runtime.deployment needs Flower: pip install 'fedppl[flower]'"
                      ) from err

__all__ = ["LocalDeployment", "DeploymentError", "free_port", "write_app", "FAST_POLL_NODES",
           "PORT_RETRIES"]

#: How many times a process whose port was taken between its choice and its bind starts again.
PORT_RETRIES = 3

#: Up to this many nodes a local deployment's SuperNodes poll often while busy (K = 10 on 2 cores:
#: 3.7 s a round against 4.8 s with Flower's own poll; K = 50: 37 s against 19 s).
FAST_POLL_NODES = 10


# fedppl's SuperNode (fedppl.runtime.flower_supernode), which imports only Flower
_SUPERNODE = Path(__file__).with_name("flower_supernode.py")


class DeploymentError(RuntimeError):
    """A local deployment that did not start, or a run that failed (with the logs)."""


def free_port(avoid: Collection[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, none of ``avoid``, chosen below the
    kernel's ephemeral range where it can: outgoing connections take their local ports from that
    range, so a port chosen there can be taken before its server binds it (at K = 50 a
    SuperNode's Runtime API failed to start that way)."""
    low = _ephemeral_low()
    if low > 10_100:
        for port in random.sample(range(10_000, low), min(200, low - 10_000)):
            if port in avoid:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise DeploymentError("no free TCP port on 127.0.0.1")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def write_app(folder: str | os.PathLike, task: str, config: Mapping[str, Any],
              name: str = "fedppl-app") -> Path:
    """A Flower app in ``folder`` (its ``pyproject.toml``) that runs fedppl's ServerApp and
    ClientApp with the task ``"package.module:function"`` and the run config ``config`` (every
    key a run may override, with its default)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{key} = {_toml(value)}" for key, value in {"task": task, **config}.items()]
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        f'[project]\nname = "{name}"\nversion = "0.1.0"\ndescription = "fedppl on Flower"\n'
        'license = "Apache-2.0"\ndependencies = ["fedppl[flower]"]\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n'
        '[tool.flwr.app]\npublisher = "fedppl"\n\n[tool.flwr.app.components]\n'
        'serverapp = "fedppl.runtime.flower:server_app"\n'
        'clientapp = "fedppl.runtime.flower:client_app"\n\n'
        "[tool.flwr.app.config]\n" + "\n".join(lines) + "\n")
    return folder


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


class _Forked:
    """A SuperNode the fork server started (it is the server's child, not ours): what
    :class:`LocalDeployment` uses of a :class:`subprocess.Popen`, its ``pid``, ``poll`` (None
    while it runs; its exit status is its parent's to know, so 0 once it has ended) and
    ``wait``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _alive(self.pid):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"SuperNode {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet collected, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 says whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


class LocalDeployment:
    """A SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1 (insecure), node ``k`` with
    ``node_config(k)`` (default ``partition-id=k num-partitions=num_nodes``); the SuperLink on
    ``port`` (default: a free one). ``isolation``: ``"process"`` (a warm ClientApp process per
    SuperNode) or ``"subprocess"`` (Flower's fresh process per message); ``jax_cache``: the
    JAX compilation cache's folder (kept after the block; default a temporary one);
    ``node_poll``: the SuperNodes' wait between checks for messages while a run is busy
    (:mod:`fedppl.runtime.flower_supernode`; None: Flower's own ``flower-supernode``; ``"auto"``:
    0.05 s up to :data:`FAST_POLL_NODES` nodes, Flower's own beyond, where the polls of many
    nodes cost the SuperLink more than they save: ``benchmarks/flower_overhead.py``);
    ``workers``: how many warm ClientApp processes serve the nodes (default one per node, as
    at separate sites; fewer share them, node ``k`` served by worker ``k % workers``, to fit
    many nodes in one machine's memory); ``superlink``: the command that starts the SuperLink,
    before its options (default Flower's ``flower-superlink``; ``benchmarks/flower_overhead.py``
    starts it through a wrapper that counts its requests); ``fork``: the SuperNodes are forks of
    one process that imported Flower once (:func:`fedppl.runtime.flower_supernode.serve`), not
    processes that each import it (about 1.5 s of CPU a node, and their modules' memory shared
    until written), where the platform can fork.

    Ports: the SuperLink's (unless ``port`` is given) and each SuperNode's Runtime API are
    chosen free (:func:`free_port`); a process whose port was taken by the time it bound it
    starts again on another, up to :data:`PORT_RETRIES` times (``restarts`` lists them), and
    the workers start only once every node's Runtime API listens. A start that still fails
    raises :class:`DeploymentError` naming the process and its port."""

    def __init__(self, num_nodes: int, *, node_config: Callable[[int], Mapping] | None = None,
                 start_timeout: float = 60.0, env: Mapping[str, str] | None = None,
                 port: int | None = None, isolation: str = "process",
                 jax_cache: str | os.PathLike | None = None,
                 node_poll: float | str | None = "auto", workers: int | None = None,
                 superlink: list[str] | None = None, fork: bool = True):
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be at least 1, got {num_nodes}")
        if isolation not in ("process", "subprocess"):
            raise ValueError(f"isolation must be 'process' or 'subprocess', got {isolation!r}")
        if node_poll == "auto":  # short polls help a few nodes and load the SuperLink of many
            node_poll = 0.05 if num_nodes <= FAST_POLL_NODES else None
        if node_poll is not None and not isinstance(node_poll, (int, float)):
            raise ValueError(f"node_poll must be seconds, None or 'auto', got {node_poll!r}")
        self.isolation, self.jax_cache, self.node_poll = isolation, jax_cache, node_poll
        self.workers = num_nodes if workers is None else max(1, min(int(workers), num_nodes))
        self.num_nodes, self.start_timeout = num_nodes, start_timeout
        self.node_config = node_config or (lambda k: {"partition-id": k,
                                                      "num-partitions": num_nodes})
        self.extra_env = dict(env or {})
        self.requested_port = port
        self.superlink = list(superlink) if superlink else None
        self.fork = bool(fork) and hasattr(os, "fork")
        self._forking = False  # the fork server has said it is ready
        self.procs: dict[str, Any] = {}  # subprocess.Popen, or _Forked for a forked node
        self.ports: dict[str, int] = {}  # each process's own port
        self.restarts: list[tuple[str, int]] = []  # (process, the port that was taken)
        self.home: Path | None = None

    # -- processes -------------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        path = Path(sys.executable).parent / name
        if not path.exists():
            raise DeploymentError(f"{name} is not installed beside {sys.executable}")
        return str(path)

    def _env(self) -> dict[str, str]:
        assert self.home is not None
        env = dict(os.environ)
        env.update({"FLWR_HOME": str(self.home / "flwr"), "FLWR_TELEMETRY_ENABLED": "0",
                    "JAX_COMPILATION_CACHE_DIR": str(self.jax_cache or self.home / "jax-cache"),
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                    "PYTHONPATH": os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")]),
                    # the SuperLink and SuperNodes start flower-superexec and flwr-* by name
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                             env.get("PATH", "")])})
        env.update(self.extra_env)
        return env

    def _start(self, name: str, args: list[str]) -> None:
        assert self.home is not None
        with open(self.home / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                env=self._env(), start_new_session=True)

    def _start_fork_server(self) -> None:
        """The SuperNodes' fork server (:func:`fedppl.runtime.flower_supernode.serve`): Flower
        imported once, each node a fork of it."""
        assert self.home is not None
        with open(self.home / "fork-server.log", "wb") as log:
            self.procs["fork-server"] = subprocess.Popen(
                [sys.executable, "-P", str(_SUPERNODE), "--fork-server"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=self._env(), start_new_session=True,
                text=True, bufsize=1)

    def _fork(self, name: str, argv: list[str]) -> None:
        """Start a SuperNode (``argv``: :func:`fedppl.runtime.flower_supernode.main`'s) from the
        fork server, its output in ``name``'s log."""
        assert self.home is not None
        server = self.procs["fork-server"]
        assert server.stdin is not None and server.stdout is not None
        if not self._forking:  # the server's first line: it has imported Flower
            waited = select.select([server.stdout], [], [], self.start_timeout)[0]
            ready = server.stdout.readline().strip() if waited else \
                f"no answer within {self.start_timeout:g} s"
            if ready != "ready":
                raise DeploymentError(f"the SuperNodes' fork server did not start ("
                                      f"{ready or 'it exited'}):\n"
                                      f"{(self.home / 'fork-server.log').read_text()[-2000:]}")
            self._forking = True
        try:
            server.stdin.write(json.dumps({"argv": argv,
                                           "log": str(self.home / f"{name}.log")}) + "\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
        except (OSError, ValueError) as err:
            raise DeploymentError(f"the SuperNodes' fork server failed to start {name}:\n"
                                  f"{(self.home / 'fork-server.log').read_text()[-2000:]}"
                                  ) from err
        self.procs[name] = _Forked(pid)

    def log(self, name: str) -> str:
        """The output of a process (``"superlink"``, ``"node-0"``...)."""
        assert self.home is not None
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> LocalDeployment:
        self.home = Path(tempfile.mkdtemp(prefix="fedppl-flower-"))
        (self.home / "flwr").mkdir()
        try:
            if self.fork:  # its imports overlap the SuperLink's start
                self._start_fork_server()
            self._start_superlink()
            (self.home / "flwr" / "config.toml").write_text(
                f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                f'address = "{self.address}"\ninsecure = true\n')
            for k in range(self.num_nodes):
                self._start_node(k)
            self._bound([f"node-{k}" for k in range(self.num_nodes)], self._start_node_named)
            runtimes = [f"127.0.0.1:{self.ports[f'node-{k}']}" for k in range(self.num_nodes)]
            for w in range(self.workers if self.isolation == "process" else 0):
                served = runtimes[w::self.workers]  # the warm ClientApp processes
                self._start(f"worker-{w}", [
                    sys.executable, "-m", "fedppl.runtime.flower_worker",
                    *[arg for a in served for arg in ("--runtime-api-address", a)]])
            self._wait(lambda: self.log("superlink").count("Activated node_id")
                       >= self.num_nodes, f"{self.num_nodes} SuperNodes to register")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_superlink(self) -> None:
        self._launch_superlink()
        if self.requested_port is None:  # a port taken since it was chosen: another
            self._bound(["superlink"], lambda name: self._launch_superlink())
        self._wait(lambda: "Uvicorn running" in self.log("superlink"), "the SuperLink")

    def _launch_superlink(self) -> None:
        self.port = self.requested_port or free_port(self.ports.values())
        self.ports["superlink"] = self.port
        self.address = f"127.0.0.1:{self.port}"
        command = self.superlink or [self._bin("flower-superlink")]
        self._start("superlink", [*command, "--insecure",
                                  "--disable-runtime-dependency-installation",
                                  "--host", "127.0.0.1", "--port", str(self.port)])

    def _start_node(self, k: int) -> None:
        name = f"node-{k}"
        port = free_port(self.ports.values())
        self.ports[name] = port
        config = " ".join(f"{key}={_toml(v)}" for key, v in self.node_config(k).items())
        flower = ["--insecure", "--superlink", self.address, "--port", str(port),
                  "--node-config", config, "--isolation", self.isolation]
        if self.fork:
            self._fork(name, ["--poll", str(self.node_poll or 0), "--", *flower])
            return
        # run as a file, not a module of fedppl's package, which imports JAX: half the memory
        # (0.13 GiB a SuperNode, not 0.28) and of the CPU to start (1.2 s, not 2.2)
        supernode = ([self._bin("flower-supernode")] if self.node_poll is None else
                     [sys.executable, "-P", str(_SUPERNODE), "--poll", str(self.node_poll), "--"])
        self._start(name, [*supernode, *flower])

    def _start_node_named(self, name: str) -> None:
        self._start_node(int(name.split("-")[1]))

    def _bound(self, names: list[str], again: Callable[[str], None]) -> None:
        """Wait until each of ``names`` listens on its port (its HTTP server says it runs); one
        that exits because its port was taken since it was chosen starts again on another
        (``again(name)``), up to :data:`PORT_RETRIES` times."""
        pending, tries = set(names), dict.fromkeys(names, 0)
        deadline = time.monotonic() + self.start_timeout
        while pending:
            for name in sorted(pending):
                log = self.log(name)
                if "Uvicorn running" in log:
                    pending.discard(name)
                elif self.procs[name].poll() is not None:
                    if "address already in use" in log and tries[name] < PORT_RETRIES:
                        tries[name] += 1
                        self.restarts.append((name, self.ports[name]))
                        self.procs.pop(name).wait()
                        again(name)
                    else:
                        raise DeploymentError(f"{name} (port {self.ports[name]}) exited while "
                                              f"starting:\n{log[-2000:]}")
            if pending and time.monotonic() > deadline:
                who = ", ".join(f"{n} (port {self.ports[n]})" for n in sorted(pending))
                raise DeploymentError(f"timed out after {self.start_timeout:g} s waiting for "
                                      f"{who} to listen")
            time.sleep(0.1)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                port = f" (port {self.ports[dead[0]]})" if dead[0] in self.ports else ""
                raise DeploymentError(f"{dead[0]}{port} exited while waiting for {what}:\n"
                                      f"{self.log(dead[0])[-2000:]}")
            if time.monotonic() > deadline:
                raise DeploymentError(f"timed out after {self.start_timeout:g} s waiting for "
                                      f"{what}:\n{self.log('superlink')[-2000:]}")
            time.sleep(0.2)

    def kill_node(self, k: int) -> None:
        """Kill SuperNode ``k`` and its ClientApp processes now, as a crash would (its worker
        too, when it serves no other node)."""
        own = self.workers == self.num_nodes
        for name in (f"node-{k}", *([f"worker-{k}"] if own else [])):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs.values():  # the SuperLink's and nodes' groups (their children)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in the group
            proc.wait(10)
            for pipe in (getattr(proc, "stdin", None), getattr(proc, "stdout", None)):
                if pipe is not None:  # the fork server's
                    with contextlib.suppress(OSError):
                        pipe.close()
        if self.home is not None and not os.environ.get("FEDPPL_KEEP_FLOWER_LOGS"):
            shutil.rmtree(self.home, ignore_errors=True)

    # -- runs ------------------------------------------------------------------------------------

    def run(self, app_dir: str | os.PathLike, run_config: Mapping[str, Any] | None = None,
            timeout: float = 600.0) -> str:
        """``flwr run`` the app in ``app_dir`` with ``run_config`` overrides; waits until the run
        ends and returns its log. A run that fails or outlasts ``timeout`` raises
        :class:`DeploymentError` with the log."""
        overrides = " ".join(f"{k}={_toml(v)}" for k, v in (run_config or {}).items())
        args = [self._bin("flwr"), "run", str(app_dir), "local", "--stream"]
        if overrides:
            args += ["--run-config", overrides]
        try:
            out = subprocess.run(args, capture_output=True, text=True, env=self._env(),
                                 timeout=timeout)
        except subprocess.TimeoutExpired as err:
            partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) \
                else str(err.stdout or "")
            raise DeploymentError(f"the run did not finish within {timeout:g} s:\n"
                                  f"{partial[-3000:]}") from err
        log = out.stdout + out.stderr
        status = self._status(log)
        if out.returncode != 0 or status != "finished:completed":
            # the ServerApp's own traceback is in the SuperLink's log (its process's output)
            raise DeploymentError(f"the run ended as {status or out.returncode}:\n{log[-2000:]}"
                                  f"\n-- SuperLink log --\n{self.log('superlink')[-4000:]}")
        return log

    def _status(self, log: str) -> str:
        run_id = next((w for line in log.splitlines() if "Successfully started run" in line
                       for w in line.split() if w.isdigit()), None)
        if run_id is None:
            return ""
        out = subprocess.run([self._bin("flwr"), "ls", "local", "--run-id", run_id, "--format",
                              "json"], capture_output=True, text=True, env=self._env(),
                             timeout=60)
        try:
            runs = json.loads(out.stdout).get("runs", [])
            return str(runs[0].get("status", "")) if runs else ""
        except (json.JSONDecodeError, AttributeError):
            return ""
