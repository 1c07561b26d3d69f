"""Flower's SuperNode with a shorter wait between its checks for messages, while a run is busy.

Flower 1.42's SuperNode asks its SuperLink for a message, and when none is waiting sleeps 3 s
before asking again (a constant in ``flwr.supernode.start_client_internal``); it looks for its
ClientApp's reply every 0.5 s. A round that sends each node one message therefore waits about
3 s at every node, whatever the work. ``python -m fedppl.runtime.flower_supernode`` runs the
same SuperNode (every ``flower-supernode`` option, unchanged) with its wait for a reply cut to
``--poll`` seconds (default 0.05), its idle wait starting at ``--poll`` after each message and
growing by a fifth each time to 0.5 s, for ``--busy`` seconds (default 30) after the node last
handled a message, and Flower's 3 s after that; it also asks again after ``--poll`` seconds,
not Flower's 1 s, for the parts of a message the SuperLink has not stored yet. An idle node asks
its SuperLink no more often than Flower's does, a busy one at most 20 times a second::

    python -m fedppl.runtime.flower_supernode --poll 0.05 -- --isolation process \\
        --superlink SERVER:9092 --root-certificates ca.crt --port 9094 \\
        --node-config "partition-id=0 num-partitions=3"

The node is Flower's; only its module's clock is wrapped (written against Flower 1.42, which
``constraints.txt`` pins). Plain ``flower-supernode`` works with fedppl too, a few seconds
slower a round.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["BusyClock", "main"]


class BusyClock:
    """The ``time`` module, with Flower's idle wait (3 s) shortened while the node is busy: the
    first wait after the node handled a message is ``poll`` seconds, each further one 1.2 times
    longer, up to ``max_wait``; after ``busy`` seconds without a message, Flower's own wait.
    (Flower's SuperNode makes shorter waits only while it handles a message: those mark it
    busy, and are cut to ``poll``.)"""

    def __init__(self, poll: float, busy: float, idle_wait: float = 3.0, max_wait: float = 0.5):
        self.poll, self.busy, self.idle_wait, self.max_wait = poll, busy, idle_wait, max_wait
        self.last, self.wait = -float("inf"), poll

    def sleep(self, seconds: float) -> None:
        now = time.monotonic()
        if seconds < self.idle_wait:  # waiting for a reply: the node is handling a message
            self.last, self.wait = now, self.poll
            time.sleep(min(seconds, self.poll))
        elif now - self.last < self.busy:
            time.sleep(min(seconds, self.wait))
            self.wait = min(self.max_wait, 1.2 * self.wait)
        else:
            time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m fedppl.runtime.flower_supernode",
                                description=__doc__.splitlines()[0],
                                epilog="Arguments after -- go to flower-supernode.")
    p.add_argument("--poll", type=float, default=0.05,
                   help="seconds between checks for a message while busy")
    p.add_argument("--busy", type=float, default=30.0,
                   help="seconds after the last message during which the node checks often")
    ours, _, theirs = (argv[:argv.index("--")], None, argv[argv.index("--") + 1:]) \
        if "--" in argv else ([], None, argv)
    args = p.parse_args(ours)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    try:
        from flwr.supernode import start_client_internal
        from flwr.supernode.cli.flower_supernode import flower_supernode
    except ImportError as err:  # pragma: no cover - the extra is installed by make test
        raise ImportError("fedppl.runtime.flower_supernode needs Flower: "
                          "pip install 'fedppl[flower]'") from err
    start_client_internal.time = BusyClock(args.poll, args.busy)  # type: ignore[assignment]
    # a message's parts the SuperLink has not stored yet: asked again after --poll seconds,
    # doubling to 0.5 s (Flower first waits 1 s, doubling to 10 s)
    start_client_internal.pull_objects = functools.partial(
        start_client_internal.pull_objects, initial_backoff=args.poll, backoff_cap=0.5)
    sys.argv = ["flower-supernode", *theirs]
    flower_supernode()


if __name__ == "__main__":
    main()
