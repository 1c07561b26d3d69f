"""Why DPO stops short of global VI on some UCI sets: the paper's protocol against one change at
a time, on one split.

Protocol (``fedppl_experiments.sgp_uci``): the split standardised on its training part, dealt
to K = 10 clients at random, sequential schedule, M = 100, ``--local-steps`` Adam(1e-2) steps
per visit. Variants:

* ``default``: ``--rounds`` rounds, App. D's initial precision 100 for q(beta) and q(Z);
* ``init_precision=1``: q(beta) and q(Z) start at precision 1;
* ``rounds x3``: three times the rounds;
* ``Z at the data``: Z held at 100 random training inputs (global VI's start), as a fixed point;
* ``adam 0.05``: a five times larger learning rate;
* ``global``: centralised VI (``--global-rounds`` rounds), the reference.

Each row reports the exact free energy of the final q, its change over the last 10 rounds (still
climbing or not), and the test log-likelihood and RMSE in original units. Run::

    python benchmarks/sgp_dpo_diagnosis.py --data yacht
    python benchmarks/sgp_dpo_diagnosis.py --data concrete --rounds 100

Prints a markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np
import optax

from fedppl.infer.sparse_gps import SGPConfig
from fedppl_experiments import sgp_uci

jax.config.update("jax_enable_x64", True)

UCI = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="yacht", help="UCI dataset folder name")
    p.add_argument("--uci-root", type=Path, default=UCI)
    p.add_argument("--split", type=int, default=0)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--global-rounds", type=int, default=30)
    p.add_argument("--local-steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: results/sgp_dpo_diagnosis_<data>.json)")
    args = p.parse_args()
    folder = args.uci_root / args.data
    if not folder.is_dir():
        raise SystemExit(f"{folder} not found (pass --uci-root)")
    prep = sgp_uci.prepare(str(folder), args.split, 10)
    X, mask = (np.asarray(a) for a in (prep.clients.stacked[0], prep.clients.mask))
    train = X[mask]
    Z0 = train[np.random.default_rng(0).choice(len(train), 100, replace=False)]
    base = {"local_steps": args.local_steps}
    variants = [
        ("default", "dpo", args.rounds, {}),
        ("init_precision=1", "dpo", args.rounds, {"init_precision": 1.0}),
        ("rounds x3", "dpo", 3 * args.rounds, {}),
        ("Z at the data", "dpo", args.rounds, {"fixed_inducing": Z0}),
        ("adam 0.05", "dpo", args.rounds, {"optimizer": optax.adam(0.05)}),
        ("global", "global", args.global_rounds, {}),
    ]
    rows = []
    for name, method, rounds, extra in variants:
        t0 = time.perf_counter()
        r = sgp_uci.fit_one(method, prep, rounds, SGPConfig(**base, **extra))
        fe = np.asarray(r["history"]["free_energy"])
        row = {"variant": name, "method": method, "rounds": rounds,
               "free_energy": float(fe[-1]),
               "free_energy_change_last_10": float(fe[-1] - fe[-10]) if len(fe) >= 10 else None,
               "log_lik": r["log_lik"], "rmse": r["rmse"], "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{name}: free energy {row['free_energy']:.1f} "
              f"(last 10 rounds {row['free_energy_change_last_10']:+.1f}), "
              f"test log-lik {row['log_lik']:.3f}, RMSE {row['rmse']:.3f}, "
              f"{row['seconds']:.0f} s", flush=True)
    lines = [f"| {args.data} split {args.split}: variant | rounds | free energy | change over "
             "the last 10 rounds | test log-lik | test RMSE |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['rounds']} | {r['free_energy']:.1f} | "
              f"{r['free_energy_change_last_10']:+.1f} | {r['log_lik']:.3f} | {r['rmse']:.3f} |"
              for r in rows]
    text = "\n".join(lines)
    print("\n" + text)
    out = args.out or Path(__file__).parent / "results" / f"sgp_dpo_diagnosis_{args.data}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "DPO against global VI, one change at a time (sequential, K = 10, M = 100)",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__},
        "rows": rows, "table_markdown": text}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
