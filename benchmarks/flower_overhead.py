"""What running on Flower costs: seconds and bytes per synchronous PVI round, embedded runtime
against Flower's Simulation Engine and its Deployment Engine (a SuperLink and K SuperNodes as
local processes, ``fedppl.runtime.deployment``), at K = 10 and 50 clients.

The task is Bayesian linear regression (5 features, 20 rows per client, closed-form local step),
so the figures are the runtime's overhead, not the local work. Seconds per round are the median
over the rounds after the first (the first compiles; it is reported apart). The Deployment
Engine runs in three forms:

* ``deployment``: each SuperNode beside a warm ClientApp process (``fedppl.runtime.flower_worker``)
  and checking for messages every 0.05 s while busy (``fedppl.runtime.flower_supernode``), with
  a cold JAX compilation cache, then ``deployment-warm-cache``: a second deployment (fresh
  processes) of the same task on the cache the first one filled;
* ``deployment-flower-poll``: the warm ClientApp processes beside Flower's own SuperNode (its
  3 s idle poll);
* ``deployment-subprocess``: Flower's default, a fresh ClientApp process for every message.

Memory per SuperNode is the proportional set size (PSS: each page shared by n processes counted
1/n to each, so that the sizes add up; resident memory where the kernel does not say) of its
processes after the run: the SuperNode's, its share of the fork server all nodes are forked
from, and with warm workers its share of theirs. Writes ``benchmarks/results/flower_overhead.json``.

``--profile`` (``deployment`` only; needs ``py-spy``) samples the SuperLink's process group
(the SuperLink, Flower's SuperExec and the ServerApp), SuperNode 0 and worker 0 through the
run at 50 Hz and splits each one's CPU by where its samples were: HTTP serving (uvicorn,
Starlette, FastAPI, AnyIO), the HTTP client (httpx), serialisation (protobuf, Flower's
message objects), Flower's own logic and state, fedppl, JAX, and samples taken while waiting;
the split, scaled to each group's measured CPU seconds per round, goes to
``benchmarks/results/flower_overhead_profile.json``.

    python benchmarks/flower_overhead.py [--clients 10 50] [--rounds 6] [--engines ...]
    python benchmarks/flower_overhead.py --engines deployment --clients 10 50 --workers 10 5 \
        --profile

(run from the repository root: the deployment's processes import this module by name).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import fedppl
from fedppl.models import linear_regression

BENCHMARK = {
    "summary": ("what Flower costs: seconds and bytes per synchronous PVI round, the embedded "
                "runtime against Flower's Simulation and Deployment Engines, K = 10 and 50"),
    "data": None,
    "quick": ["--clients", "10", "--rounds", "3", "--engines", "embedded", "simulation"],
    "full": [[],
             ["--engines", "deployment", "--clients", "10", "--rounds", "6", "--repeats", "3",
              "--out", "benchmarks/results/flower_overhead_forked_nodes.json"],
             ["--engines", "deployment", "--clients", "50", "--workers", "5", "--rounds", "6",
              "--repeats", "3", "--out", "benchmarks/results/flower_overhead_forked_nodes.json"],
             ["--engines", "deployment", "--clients", "100", "--workers", "5", "--rounds", "3",
              "--out", "benchmarks/results/flower_overhead_forked_nodes.json"]],
    "cost": "quick ~2 min; full ~60 min (needs several GiB for the SuperNodes)",
}

jax.config.update("jax_enable_x64", True)

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "flower_overhead.json"
ENGINES = ("embedded", "simulation", "deployment", "deployment-warm-cache",
           "deployment-flower-poll", "deployment-subprocess")
# resident memory of one SuperNode with its warm ClientApp process (measured by this script at
# K = 10); what the memory check before a run assumes
NODE_GIB = 0.6


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
    pvi = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression),
                     schedule=str(run_config.get("schedule", "synchronous")))
    return Task(pvi, clients.client, K, int(run_config["num-rounds"]))


def _row(engine: str, K: int, history: dict, wall: float, schedule: str) -> dict:
    seconds = np.asarray(history["seconds"])
    up = history.get("wire_bytes_up", history["bytes_up"])
    down = history.get("wire_bytes_down", history["bytes_down"])
    return {"engine": engine, "clients": K, "schedule": schedule, "rounds": len(seconds),
            "seconds_per_round": float(np.median(seconds[1:] if len(seconds) > 1 else seconds)),
            "first_round_seconds": float(seconds[0]),
            "bytes_up_per_round": float(np.median(up)),
            "bytes_down_per_round": float(np.median(down)), "wall_seconds": wall}


def _usage(fed) -> dict[str, tuple[float, float]]:
    """Memory (GiB) and CPU seconds of each of a local deployment's process groups, by name."""
    from _proc import group_usage  # benchmarks/ is on the path of the script, not of its nodes

    return group_usage(fed.procs)


# where a sample's innermost recognised frame is: (layer, substrings of its file's path)
LAYERS = (("JAX", ("/jax/", "/jaxlib/")),
          ("serialisation", ("/google/protobuf/", "/flwr/common/serde", "/flwr/common/inflatable",
                             "/flwr/supercore/inflatable/", "/flwr/proto/", "/flwr/common/record/",
                             "/flwr/common/message")),
          ("HTTP client", ("/httpx/", "/httpcore/")),
          ("HTTP server", ("/uvicorn/", "/starlette/", "/fastapi/", "/anyio/", "/h11/",
                           "/pydantic")),
          ("fedppl", ("/fedppl/",)),
          ("Flower", ("/flwr/",)))
WAITS = ("wait", "sleep", "select", "poll", "acquire", "recv", "read", "get", "accept")


def _layer(stack: list[str]) -> str:
    """The layer a sample's CPU belongs to: ``waiting`` where its innermost frame is a wait (the
    sampler saw the thread blocked in it), else that of its innermost recognised frame."""
    leaf = stack[-1].split(" (", 1)[0].rsplit(".", 1)[-1]
    if leaf.lower().startswith(WAITS) or leaf in ("_worker", "_bootstrap_inner"):
        return "waiting"
    for frame in reversed(stack):
        path = "/" + frame.rsplit("(", 1)[-1]  # py-spy names files from site-packages down
        for layer, parts in LAYERS:
            if any(part in path for part in parts):
                return layer
    return "other Python"


def _split(path: Path) -> dict[str, float]:
    """py-spy's collapsed stacks at ``path`` as each layer's share of the samples that were not
    waiting (a blocked thread spends no CPU), and ``waiting``: those samples' share of all."""
    counts: dict[str, float] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")[1:]  # the first is the process
        if frames and n.isdigit():
            layer = _layer(frames)
            counts[layer] = counts.get(layer, 0) + int(n)
    waiting = counts.pop("waiting", 0)
    busy = sum(counts.values()) or 1
    out = {k: v / busy for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    return {**out, "waiting": waiting / ((busy + waiting) or 1)}


def _spies(fed, folder: str) -> list:
    """py-spy recorders on the SuperLink's group, SuperNode 0 and worker 0 (whichever exist)."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        raise ImportError("--profile needs py-spy (pip install py-spy)")
    return [(name, subprocess.Popen(
        [spy, "record", "-p", str(fed.procs[name].pid), "--subprocesses", "-r", "50", "-f",
         "raw", "-o", os.path.join(folder, f"{name}.txt"), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for name in ("superlink", "node-0", "worker-0") if name in fed.procs]


def _deploy(engine: str, K: int, rounds: int, workers: int | None, cache: str,
            schedule: str, profile: bool = False) -> dict:
    from fedppl.runtime.deployment import LocalDeployment

    options = {"deployment": {"node_poll": 0.05}, "deployment-warm-cache": {"node_poll": 0.05},
               "deployment-flower-poll": {"node_poll": None},
               "deployment-subprocess": {"isolation": "subprocess", "node_poll": None}}
    app = Path(__file__).resolve().parents[1] / "examples" / "flower"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        counts = Path(out) / "requests.json"
        with LocalDeployment(K, jax_cache=cache, workers=workers, start_timeout=300,
                             env={"FEDPPL_REQUEST_COUNTS": str(counts)},
                             superlink=[sys.executable, str(HERE / "_counted_superlink.py")],
                             **options.get(engine, {})) as fed:

            def run(n: int) -> tuple[dict, dict, dict]:  # a run's history, CPU and requests
                before, asked = _usage(fed), _requests(counts)
                fed.run(app, run_config={"task": "benchmarks.flower_overhead:task",
                                         "num-clients": K, "num-rounds": n,
                                         "schedule": schedule, "result-dir": out},
                        timeout=3600)
                after, answered = _usage(fed), _requests(counts, at_least=asked)
                with open(os.path.join(out, "result.json")) as f:
                    history = json.load(f)["history"]
                return (history, {g: after[g][1] - before.get(g, (0.0, 0.0))[1] for g in after},
                        {p: answered[p] - asked.get(p, 0) for p in answered})

            spies = _spies(fed, out) if profile else []
            history, cpu_run, _ = run(rounds)  # the row's times (a cold cache: the first round)
            with np.load(os.path.join(out, "state.npz")) as f:  # the ServerApp's last state
                state = [f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))]
            import signal

            for _, spy in spies:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits
            splits = {}
            for name, spy in spies:
                spy.wait(60)
                splits[name] = _split(Path(out) / f"{name}.txt")
            # the rounds alone: a run of 2n rounds less one of n on the warm deployment (each
            # run's own set-up, its ServerApp's start, its first round and finish cancel out)
            _, cpu_short, req_short = run(rounds)
            _, cpu_long, req_long = run(2 * rounds)
            rss = {n: gib for n, (gib, _) in _usage(fed).items()}
    row = _row(engine, K, history, time.perf_counter() - t0, schedule)
    row["max_abs_difference_to_embedded"] = _difference(state, K, rounds, schedule)
    nodes = sum(v for n, v in rss.items() if n.startswith(("node-", "worker-", "fork-server")))

    def cpu(used: dict, prefix: str, per: float = rounds) -> float:  # CPU seconds a round
        return sum(v for n, v in used.items() if n.startswith(prefix)) / per

    steady = {n: cpu_long.get(n, 0.0) - cpu_short.get(n, 0.0) for n in cpu_long}
    requests = {p: (req_long.get(p, 0) - req_short.get(p, 0)) / (rounds * K) for p in req_long}
    row.update(cpu_seconds_per_round={"superlink": cpu(cpu_run, "superlink"),
                                      "supernodes": cpu(cpu_run, "node-"),
                                      "workers": cpu(cpu_run, "worker-")},
               steady_cpu_seconds_per_round={"superlink": cpu(steady, "superlink"),
                                             "supernodes": cpu(steady, "node-"),
                                             "workers": cpu(steady, "worker-")},
               superlink_cpu_ms_per_node_per_round=1e3 * cpu(steady, "superlink") / K,
               superlink_cpu_ms_per_node_per_round_all_in=1e3 * cpu(cpu_run, "superlink") / K,
               superlink_requests_per_node_per_round=round(sum(requests.values()), 2),
               superlink_requests_by_path={p: round(v, 2) for p, v in sorted(
                   requests.items(), key=lambda kv: -kv[1]) if v > 0},
               memory_gib_per_supernode=nodes / K,
               workers=0 if engine == "deployment-subprocess" else workers or K,
               superlink_gib=rss.get("superlink", 0.0))
    if profile:  # each group's CPU a round, split by the layers its samples were in
        per = {"superlink": cpu(cpu_run, "superlink"), "node-0": cpu(cpu_run, "node-0"),
               "worker-0": cpu(cpu_run, "worker-0")}
        row["cpu_breakdown_seconds_per_round"] = {
            name: {layer: share * per[name] for layer, share in split.items()
                   if layer != "waiting"} for name, split in splits.items()}
        row["waiting_share_of_samples"] = {n: split["waiting"] for n, split in splits.items()}
    return row


def _difference(state: list, K: int, rounds: int, schedule: str) -> float | str:
    """The largest absolute difference between the deployment's last server state and the
    embedded runtime's on the same task, planned as on a deployment."""
    from fedppl.runtime.embedded import Runtime, recording

    t = task({"num-clients": K, "num-rounds": rounds, "schedule": schedule})
    clients = fedppl.Clients.from_list([t.load_partition(k) for k in range(K)])
    last: dict = {}  # planned as on a deployment, whose server holds no data
    t.method.run(jax.random.key(0), clients, rounds, progress_bar=False,
                 runtime=Runtime(recording(last), data_at_server=False))
    want = [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree_util.tree_leaves(last["server"])]
    if len(want) != len(state) or any(a.shape != b.shape for a, b in zip(state, want, strict=True)):
        return "the states' structures differ"
    return max(float(np.max(np.abs(a.astype(float) - b.astype(float)), initial=0.0))
               for a, b in zip(state, want, strict=True))


def _requests(path: Path, at_least: dict | None = None) -> dict[str, int]:
    """The SuperLink's requests so far by path (``_counted_superlink.py``'s file), once it
    holds the requests of a run that just ended (its file is written every half second)."""
    for _ in range(20):
        time.sleep(0.6)
        got = json.loads(path.read_text()) if path.exists() else {}
        if sum(got.values()) > sum((at_least or {}).values()):
            return got
    return got


def run(engine: str, K: int, rounds: int, workers: int | None = None,
        cache: str | None = None, schedule: str = "synchronous", profile: bool = False) -> dict:
    config = {"num-clients": K, "num-rounds": rounds, "schedule": schedule}
    t0 = time.perf_counter()
    if engine == "embedded":
        t = task(config)
        clients = fedppl.Clients.from_list([t.load_partition(k) for k in range(K)])
        result = t.method.run(jax.random.key(0), clients, rounds, progress_bar=False)
    elif engine == "simulation":
        from fedppl.runtime.flower import FlowerApp

        result = FlowerApp(task).simulate(config)
    else:
        need, have = (workers or K) * NODE_GIB + K * 0.15, _memory_gib()
        if need > 0.8 * have:
            raise MemoryError(f"{K} SuperNodes with {workers or K} warm ClientApp processes "
                              f"need about {need:.0f} GiB; this machine has {have:.0f} GiB "
                              "(give --workers)")
        assert cache is not None
        return _deploy(engine, K, rounds, workers, cache, schedule, profile)
    return _row(engine, K, result.history, time.perf_counter() - t0, schedule)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--schedule", default="synchronous", choices=("synchronous", "sequential"))
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="warm ClientApp processes per K (default one per SuperNode)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per engine and K; the row is the median over them")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path; rows of engines and sizes not run are kept from it "
                   "(default results/flower_overhead.json, with --profile "
                   "results/flower_overhead_profile.json)")
    p.add_argument("--profile", action="store_true",
                   help="sample the processes with py-spy and split their CPU by layer")
    args = p.parse_args()
    out = args.out or (OUT.with_name("flower_overhead_profile.json") if args.profile else OUT)
    from _provenance import stamp  # benchmarks/ is on the path of the script, not of its nodes
    rows = []
    for i, K in enumerate(args.clients):
        workers = None if args.workers is None else args.workers[i]
        cache = tempfile.mkdtemp(prefix="fedppl-jax-cache-")  # cold, then warm
        for engine in args.engines:
            try:
                runs = []
                for _ in range(args.repeats):
                    if engine == "deployment":  # each repeat's first round from a cold cache
                        cache = tempfile.mkdtemp(prefix="fedppl-jax-cache-")
                    runs.append(run(engine, K, args.rounds, workers, cache, args.schedule,
                                    args.profile))
            except ImportError as err:
                print(f"skipping {engine}: {err}")
                continue
            except MemoryError as err:
                print(f"skipping {engine} K={K}: {err}")
                rows.append({"engine": engine, "clients": K, "schedule": args.schedule,
                     "skipped": str(err)})
                continue
            r = {k: (float(np.median([x[k] for x in runs])) if isinstance(v, float) else v)
                 for k, v in runs[0].items()}
            if "cpu_breakdown_seconds_per_round" in r:
                print(json.dumps(r["cpu_breakdown_seconds_per_round"], indent=1))
            r["repeats"] = args.repeats
            rows.append(r)
            print(f"{engine:>11} {args.schedule} K={K:<4} {r['seconds_per_round']:8.3f} s/round  "
                  f"(first {r['first_round_seconds']:.2f} s)  up {r['bytes_up_per_round']:.0f} B"
                  f"  down {r['bytes_down_per_round']:.0f} B  wall {r['wall_seconds']:.1f} s")
    # rows of engines and sizes not run this time are kept from the last file
    def key(r):
        return r["engine"], r["clients"], r.get("schedule", "sequential")

    done = {key(r) for r in rows}
    if out.exists():
        rows = [r for r in json.loads(out.read_text())["rows"] if key(r) not in done] + rows
    rows.sort(key=lambda r: (r.get("schedule", "sequential") != "synchronous", r["clients"],
                             ENGINES.index(r["engine"])))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamp({
        "what": "seconds and bytes per PVI round (BLR, 5 features, 20 rows per client; each "
                "row's schedule): embedded vs Flower engines; median over rounds after the "
                "first, then over repeats",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                   f"{jax.default_backend()}",
        "flwr": __import__("flwr").__version__, "rows": rows}), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
