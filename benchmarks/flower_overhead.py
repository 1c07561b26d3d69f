"""What running on Flower costs: seconds and bytes per synchronous PVI round, embedded runtime
against Flower's Simulation Engine and its Deployment Engine (a SuperLink and K SuperNodes as
local processes, ``fedppl.runtime.deployment``), at K = 10 and 100 clients.

The task is Bayesian linear regression (5 features, 20 rows per client, closed-form local step),
so the figures are the runtime's overhead, not the local work. Seconds per round are the median
over the rounds after the first (the first compiles). Writes
``benchmarks/results/flower_overhead.json``.

    python benchmarks/flower_overhead.py [--clients 10 100] [--rounds 4] [--engines ...]

(run from the repository root: the deployment's processes import this module by name).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import fedppl
from fedppl.models import linear_regression

jax.config.update("jax_enable_x64", True)

OUT = Path(__file__).parent / "results" / "flower_overhead.json"
ENGINES = ("embedded", "simulation", "deployment")
# resident memory of one idle SuperNode (flower-supernode and its children), measured here with
# `ps` on fedppl.runtime.deployment.LocalDeployment's processes; a ClientApp process with JAX and
# fedppl peaks at about 0.5 GiB more while it handles a message
NODE_GIB = 0.26


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def task(run_config):
    from fedppl.runtime.flower import Task

    jax.config.update("jax_enable_x64", True)
    K = int(run_config["num-clients"])
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20 * K, 5))
    y = X @ rng.normal(size=5) + rng.normal(size=20 * K)
    clients = fedppl.partition.homogeneous(X, y, num_clients=K, seed=0)
    pvi = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression))
    return Task(pvi, clients.client, K, int(run_config["num-rounds"]))


def _row(engine: str, K: int, history: dict, wall: float) -> dict:
    seconds = np.asarray(history["seconds"])
    up = history.get("wire_bytes_up", history["bytes_up"])
    down = history.get("wire_bytes_down", history["bytes_down"])
    return {"engine": engine, "clients": K, "rounds": len(seconds),
            "seconds_per_round": float(np.median(seconds[1:] if len(seconds) > 1 else seconds)),
            "first_round_seconds": float(seconds[0]),
            "bytes_up_per_round": float(np.median(up)),
            "bytes_down_per_round": float(np.median(down)), "wall_seconds": wall}


def run(engine: str, K: int, rounds: int) -> dict:
    config = {"num-clients": K, "num-rounds": rounds}
    t0 = time.perf_counter()
    if engine == "embedded":
        t = task(config)
        clients = fedppl.Clients.from_list([t.load_partition(k) for k in range(K)])
        result = t.method.run(jax.random.key(0), clients, rounds, progress_bar=False)
    elif engine == "simulation":
        from fedppl.runtime.flower import FlowerApp

        result = FlowerApp(task).simulate(config)
    else:
        from fedppl.runtime.deployment import LocalDeployment

        need, have = K * NODE_GIB, _memory_gib()
        if need > 0.8 * have:
            raise MemoryError(f"{K} SuperNodes need about {need:.0f} GiB ({NODE_GIB} GiB each, "
                              f"measured, before their ClientApp processes); this machine has "
                              f"{have:.0f} GiB")

        app = Path(__file__).resolve().parents[1] / "examples" / "flower"
        with tempfile.TemporaryDirectory() as out, LocalDeployment(K) as fed:
            fed.run(app, run_config={"task": "benchmarks.flower_overhead:task",
                                     "num-clients": K, "num-rounds": rounds,
                                     "result-dir": out}, timeout=3600)
            with open(os.path.join(out, "result.json")) as f:
                history = json.load(f)["history"]
        return _row(engine, K, history, time.perf_counter() - t0)
    return _row(engine, K, result.history, time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per engine and K; the row is the median over them")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    args = p.parse_args()
    rows = []
    for K in args.clients:
        for engine in args.engines:
            try:
                runs = [run(engine, K, args.rounds) for _ in range(args.repeats)]
            except ImportError as err:
                print(f"skipping {engine}: {err}")
                continue
            except MemoryError as err:
                print(f"skipping {engine} K={K}: {err}")
                rows.append({"engine": engine, "clients": K, "skipped": str(err)})
                continue
            r = {k: (float(np.median([x[k] for x in runs])) if isinstance(v, float) else v)
                 for k, v in runs[0].items()}
            r["repeats"] = args.repeats
            rows.append(r)
            print(f"{engine:>11} K={K:<4} {r['seconds_per_round']:8.3f} s/round  "
                  f"(first {r['first_round_seconds']:.2f} s)  up {r['bytes_up_per_round']:.0f} B"
                  f"  down {r['bytes_down_per_round']:.0f} B  wall {r['wall_seconds']:.1f} s")
    # rows of engines and sizes not run this time are kept from the last file
    done = {(r["engine"], r["clients"]) for r in rows}
    if OUT.exists():
        rows = [r for r in json.loads(OUT.read_text())["rows"]
                if (r["engine"], r["clients"]) not in done] + rows
    rows.sort(key=lambda r: (r["clients"], ENGINES.index(r["engine"])))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "seconds and bytes per synchronous PVI round (BLR, 5 features, 20 rows per "
                "client): embedded vs Flower engines; median over rounds after the first, then "
                "over repeats",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                   f"{jax.default_backend()}",
        "flwr": __import__("flwr").__version__, "rows": rows}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
