"""What starting a local Flower deployment costs: seconds to start and stop, CPU and memory per
SuperNode, with the SuperNodes forked from one process that imported Flower
(``LocalDeployment(fork=True)``, the default) against each started as a process of its own.

Each repeat starts a SuperLink, K SuperNodes and W warm ClientApp workers
(``fedppl.runtime.deployment.LocalDeployment``), waits until every node has registered, then
reads each process group's CPU seconds and memory from ``/proc`` (memory as the proportional set
size: a page shared by n processes counts 1/n to each, so a forked node's share of the pages it
has not written is small), and stops it. No run: :mod:`benchmarks.flower_overhead` measures
rounds. Rows are medians over the repeats. Linux only (``/proc``).

    python benchmarks/flower_start.py                       # K = 10 and 100, both ways
    python benchmarks/flower_start.py --clients 10 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from _proc import group_usage
from _provenance import stamp

from fedppl.runtime.deployment import LocalDeployment

BENCHMARK = {
    "summary": ("what starting a local Flower deployment costs: start and stop seconds, CPU and "
                "memory per SuperNode, forked SuperNodes against a process each, K = 10 and 100"),
    "data": None,
    "quick": ["--clients", "10", "--repeats", "1"],
    "full": [[]],
    "cost": "quick ~1 min; full ~8 min (100 SuperNodes need about 10 GiB started one by one)",
}

OUT = Path(__file__).resolve().parent / "results" / "flower_start.json"


def once(K: int, workers: int, fork: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    with LocalDeployment(K, workers=workers, fork=fork, start_timeout=600) as fed:
        started = time.perf_counter() - t0
        used = {n: (cpu, gib) for n, (gib, cpu) in group_usage(fed.procs).items()}
        t1 = time.perf_counter()
    stopped = time.perf_counter() - t1

    def total(prefix: str, i: int) -> float:
        return sum(v[i] for n, v in used.items() if n.startswith(prefix))

    return {"start_seconds": started, "stop_seconds": stopped,
            "node_cpu_seconds": (total("node-", 0) + total("fork-server", 0)) / K,
            "node_gib": (total("node-", 1) + total("fork-server", 1)) / K,
            "superlink_cpu_seconds": total("superlink", 0),
            "worker_cpu_seconds": total("worker-", 0) / workers,
            "worker_gib": total("worker-", 1) / workers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="warm workers per K (default 1 at K <= 10, else 5)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    rows = []
    for i, K in enumerate(args.clients):
        W = args.workers[i] if args.workers else (1 if K <= 10 else 5)
        for fork in (True, False):
            runs = [once(K, W, fork) for _ in range(args.repeats)]
            row = {"clients": K, "workers": W, "fork": fork, "repeats": args.repeats,
                   **{k: float(np.median([r[k] for r in runs])) for k in runs[0]}}
            rows.append(row)
            print(f"K={K:<4} W={W} fork={fork!s:5}  start {row['start_seconds']:6.1f} s  "
                  f"stop {row['stop_seconds']:5.1f} s  per node: CPU "
                  f"{row['node_cpu_seconds']:.2f} s, {1024 * row['node_gib']:.0f} MiB")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamp({
        "what": "starting and stopping a LocalDeployment (SuperLink, K SuperNodes, W warm "
                "workers) until every node registered; CPU and PSS per process group from "
                "/proc; medians over repeats",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "rows": rows}), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
