"""Flower's SuperNode with a shorter wait between its checks for messages, while a run is busy.

Flower 1.42's SuperNode asks its SuperLink for a message, and when none is waiting sleeps 3 s
before asking again (a constant in ``flwr.supernode.start_client_internal``); it looks for its
ClientApp's reply every 0.5 s. A round that sends each node one message therefore waits about
3 s at every node, whatever the work. ``python -m fedppl.runtime.flower_supernode`` runs the
same SuperNode (every ``flower-supernode`` option, unchanged) with its wait for a reply cut to
``--poll`` seconds (default 0.05); after each message its first check for the next comes
``--lead`` (default 0.8) times its shortest recent wait for one later (the round's rhythm), the
next ones every ``--poll`` seconds, each wait longer by a fifth up to 0.5 s (or a tenth of that
shortest wait, when longer), for ``--busy`` seconds (default 30) after the node last handled a
message, and Flower's 3 s after that. It also asks again after ``--poll`` seconds, not Flower's
1 s, doubling to the same cap, for the parts of a message the SuperLink has not stored yet. An
idle node asks its SuperLink no more often than Flower's does, a busy one at most 20 times a
second, and one whose rounds keep their rhythm about twice a round::

    python -m fedppl.runtime.flower_supernode --poll 0.05 -- --isolation process \\
        --superlink SERVER:9092 --root-certificates ca.crt --port 9094 \\
        --node-config "partition-id=0 num-partitions=3"

The module imports only Flower, so it can run as a file, without fedppl's package (which imports
JAX): ``python -P path/to/fedppl/runtime/flower_supernode.py ...`` takes half the memory (0.13
GiB, against 0.28) and of the CPU to start, what ``LocalDeployment`` does.

The node is Flower's; only its module's clock is wrapped (written against Flower 1.42, which
``constraints.txt`` pins). Plain ``flower-supernode`` works with fedppl too, a few seconds
slower a round.

``python -P flower_supernode.py --fork-server`` imports Flower once and then starts SuperNodes
by forking itself, one per line it reads (:func:`serve`): a node so started costs a fork rather
than the 1.5 s of CPU its imports take, and shares the imported modules' memory with its
siblings until it writes to it (``LocalDeployment`` starts its nodes this way).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

__all__ = ["BusyClock", "Rhythm", "main", "serve"]


class Rhythm:
    """A process's waits for its next message, learned from its last ``keep`` (a round's
    rhythm: the server waits for the other nodes and updates). ``busy(now)`` marks a message
    handled, ``idle(now)`` a wait for one, and returns the wait before the first check:
    ``lead`` times the shortest of them (0 until it has waited once). ``cap(floor)``: the
    longest wait between later checks, ``share`` of that shortest wait (at least ``floor``), so
    that a process checks a bounded number of times a round however long the rounds grow (at
    K = 100 on 2 cores a round took 36 s, and checks every 0.5 s cost the SuperLink more than
    the messages)."""

    def __init__(self, lead: float = 0.8, keep: int = 3, share: float = 0.1):
        self.lead, self.keep, self.share = lead, keep, share
        self.idle_from: float | None = None  # when the process last ran out of messages
        self.gaps: list[float] = []  # its last waits for a message

    def busy(self, now: float) -> None:
        if self.idle_from is not None:  # a message came: how long the process waited
            self.gaps = [*self.gaps[1 - self.keep:], now - self.idle_from]
            self.idle_from = None

    def idle(self, now: float) -> float | None:
        """The wait before the first check for the next message (None: not the first)."""
        if self.idle_from is not None:
            return None
        self.idle_from = now
        return self.lead * min(self.gaps) if self.gaps else 0.0

    def forget(self) -> None:
        """The current wait is not one for a round's message (the process went idle)."""
        self.idle_from = None

    def cap(self, floor: float) -> float:
        return max(floor, self.share * min(self.gaps)) if self.gaps else floor


class BusyClock:
    """The ``time`` module, with Flower's idle wait (3 s) shortened while the node is busy: the
    first check after a message comes when its :class:`Rhythm` says, the next ones every
    ``poll`` seconds, each wait 1.2 times longer, up to ``max_wait`` (or the rhythm's
    :meth:`~Rhythm.cap`, when longer); after ``busy`` seconds
    without a message, Flower's own wait. (Flower's SuperNode makes shorter waits only while it
    handles a message: those mark it busy, and are cut to ``poll``.) ``clock`` is the time
    module it wraps (a test's).

    >>> class Fake:  # a clock whose sleeps only move its time on
    ...     now = 0.0
    ...     def monotonic(self): return self.now
    ...     def sleep(self, s): self.now += s
    >>> fake = Fake()
    >>> clock = BusyClock(0.05, 30.0, clock=fake)
    >>> clock.sleep(0.5)                    # waiting for the ClientApp's reply: busy
    >>> for _ in range(8): clock.sleep(3.0)  # no message yet: 0.05, 0.06, 0.072... (0.825 s)
    >>> clock.sleep(0.5)                    # the next message came
    >>> before = fake.now; clock.sleep(3.0)  # after it, the first check: 0.8 x 0.825 s later
    >>> round(fake.now - before, 2)
    0.66
    """

    def __init__(self, poll: float, busy: float, idle_wait: float = 3.0, max_wait: float = 0.5,
                 lead: float = 0.8, clock: Any = time):
        self.poll, self.busy, self.idle_wait, self.max_wait = poll, busy, idle_wait, max_wait
        self.rhythm, self.clock = Rhythm(lead), clock
        self.last, self.wait = -float("inf"), poll

    def sleep(self, seconds: float) -> None:
        now = self.clock.monotonic()
        if seconds < self.idle_wait:  # waiting for a reply: the node is handling a message
            self.rhythm.busy(now)
            self.last, self.wait = now, self.poll
            self.clock.sleep(min(seconds, self.poll))
        elif now - self.last < self.busy:
            ahead = self.rhythm.idle(now)
            if ahead is not None and ahead > self.wait:
                self.clock.sleep(min(seconds, ahead))
                return
            self.clock.sleep(min(seconds, self.wait))
            self.wait = min(self.rhythm.cap(self.max_wait), 1.2 * self.wait)
        else:
            self.rhythm.forget()
            self.clock.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.clock, name)


def _flower() -> tuple[Any, Any]:
    """Flower's SuperNode module and command (the imports that take a node's start)."""
    try:
        from flwr.supernode import start_client_internal
        from flwr.supernode.cli.flower_supernode import flower_supernode
    except ImportError as err:  # pragma: no cover - the extra is installed by make test
        raise ImportError("fedppl.runtime.flower_supernode needs Flower: "
                          "pip install 'fedppl[flower]'") from err
    return start_client_internal, flower_supernode


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m fedppl.runtime.flower_supernode",
                                description=__doc__.splitlines()[0],
                                epilog="Arguments after -- go to flower-supernode.")
    p.add_argument("--poll", type=float, default=0.05,
                   help="seconds between checks for a message while busy (0: Flower's own "
                        "SuperNode, unchanged)")
    p.add_argument("--busy", type=float, default=30.0,
                   help="seconds after the last message during which the node checks often")
    p.add_argument("--lead", type=float, default=0.8,
                   help="the first check after a message, as a share of the node's shortest "
                        "recent wait for one (0: at once)")
    ours, _, theirs = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) \
        if "--" in argv else ([], None, argv)
    args = p.parse_args(ours)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    start_client_internal, flower_supernode = _flower()
    if args.poll <= 0:  # Flower's own SuperNode, unchanged
        sys.argv = ["flower-supernode", *theirs]
        flower_supernode()
        return
    clock = BusyClock(args.poll, args.busy, lead=args.lead)
    start_client_internal.time = clock
    # a message's parts the SuperLink has not stored yet: asked again after --poll seconds,
    # doubling to 0.5 s or the rhythm's cap (Flower first waits 1 s, doubling to 10 s)
    pull = start_client_internal.pull_objects

    def pull_objects(*args_: Any, **kwargs: Any) -> Any:
        return pull(*args_, **kwargs, initial_backoff=args.poll,
                    backoff_cap=clock.rhythm.cap(0.5))

    start_client_internal.pull_objects = pull_objects
    sys.argv = ["flower-supernode", *theirs]
    flower_supernode()


def serve(requests: Iterable[str] = sys.stdin, replies: TextIO = sys.stdout) -> None:
    """A fork server for SuperNodes: imports Flower, writes ``ready``, then for each line of
    ``requests`` (JSON: ``argv``, :func:`main`'s arguments, ``--poll 0`` for Flower's own
    SuperNode; ``log``, the file its output goes to) forks a SuperNode in a session of its own
    (its process group id is its pid) and writes its pid. It reaps its children as they end, and
    ends when ``requests`` does; the nodes it started go on. Each node exits as its own process
    would: its exit handlers run, then it ends with its exit status."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    _flower()
    gc.freeze()  # the modules' objects stay in the pages the nodes share
    signal.signal(signal.SIGCHLD, _reap)
    print("ready", file=replies, flush=True)
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _node(list(request["argv"]), str(request["log"]))
        print(pid, file=replies, flush=True)


def _reap(signum: int, frame: Any) -> None:
    """Collect every child that has ended (a SIGCHLD handler)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _node(argv: list[str], log: str) -> None:  # pragma: no cover - runs in the forked child
    """A forked child: its own session, its output to ``log``, then the SuperNode; never
    returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    code: Any = 0
    try:
        main(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if not isinstance(code, int):  # sys.exit("message") prints it and exits with 1
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        serve()
    else:
        main()
