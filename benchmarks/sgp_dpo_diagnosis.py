"""Why DPO stops short of global VI on some UCI sets: the paper's protocol against one change at
a time, on one split.

Protocol (``fedppl_experiments.sgp_uci``): the split standardised on its training part, dealt
to K = 10 clients at random, sequential schedule, M = 100, ``--local-steps`` Adam(1e-2) steps
per visit. Variants:

Every variant but the last group starts from the paper's DPO (``PAPER_DPO``: q(Z)'s sds
learnt, alpha = 0.1, a diagonal S_k), which was FederatedSGP's default before the remedy:

* ``default``: the paper's DPO, ``--rounds`` rounds, App. D's initial precision 100 for q(beta)
  and q(Z);
* ``init_precision=1``: q(beta) and q(Z) start at precision 1;
* ``rounds x3``: three times the rounds;
* ``Z at the data``: Z held at 100 random training inputs (global VI's start), as a fixed point;
* ``adam 0.05``: a five times larger learning rate;
* ``pseudo_fraction=1``: M_k = N_k pseudo-points instead of 0.8 N_k (a client's likelihood
  term has rank min(N_k, M) in u; M_k below that cannot represent it);
* ``pseudo_fraction=1, init_precision=1``: both changes;
* ``covariance=noise``: S_k = noise^2 diag(exp(s)), the pseudo-noise following the learnt noise;
* ``Z at the data, covariance=noise``: both;
* ``init_inducing=pseudo-inputs``: q(Z) starts at 100 of the clients' pseudo-inputs (data rows);
* ``num_samples=8``: 8 draws of (beta, Z) per local step instead of 1;
* ``alpha=1``, ``alpha=0``: the weight of q(Z)'s KL in the free energies (0.1 in the paper);
* ``fedavg-z``: the same DPO factors with a point Z averaged by FedAvg instead of q(Z);
* ``global, Z at the data``: centralised VI with Z held where ``Z at the data`` holds it;
* ``global``: centralised VI (``--global-rounds`` rounds), the reference.

The remedy (q(Z)'s sds held, not learnt; its means learnt; ``sd`` is q(Z)'s sd in standardised
input units, ``1 / sqrt(inducing_precision)``):

* ``sd held at 0.1``: q(Z)'s sds held at their start, the paper's alpha;
* ``sd held at 0.1, alpha=0.01``; ``sd held at 0.1, alpha=0.01, covariance=noise``;
* ``sd held at 0.01, alpha=0``; ``sd held at 0.01, alpha=0, covariance=noise``;

``sd held at 0.1, alpha=0.01, covariance=noise`` is ``FederatedSGP("dpo")``'s default now
(``DPO_DEFAULTS``).

Each row reports the exact free energy of the final q, its change over the last 10 rounds (still
climbing or not), the test log-likelihood and RMSE in original units, the learnt noise sd
(standardised units, q(beta)'s mean) and the median sd of q(Z)'s entries (HVM only). Run::

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
from _provenance import stamp

from fedppl.algorithms import sgp_pvi
from fedppl.families import gaussian as g
from fedppl.infer.sparse_gps import PAPER_DPO, SGPConfig
from fedppl_experiments import sgp_uci

BENCHMARK = {
    "summary": ("why DPO stops short of global VI on some UCI sets: the paper's protocol against "
                "one change at a time (rounds, inducing inputs, local steps)"),
    "data": ["../shared/data/uci"],
    "quick": ["--data", "yacht", "--rounds", "10", "--global-rounds", "10", "--local-steps", "10"],
    "full": [["--data", "yacht"], ["--data", "concrete", "--rounds", "100"]],
    "cost": "quick ~3 min; full ~10-30 min per set",
}

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
    p.add_argument("--only", nargs="+", default=None,
                   help="run only these variants (names as in the table)")
    args = p.parse_args()
    folder = args.uci_root / args.data
    if not folder.is_dir():
        raise SystemExit(f"{folder} not found (pass --uci-root)")
    prep = sgp_uci.prepare(str(folder), args.split, 10)
    X, mask = (np.asarray(a) for a in (prep.clients.stacked[0], prep.clients.mask))
    train = X[mask]
    Z0 = train[np.random.default_rng(0).choice(len(train), 100, replace=False)]
    steps = {"local_steps": args.local_steps, "inner_steps": args.local_steps}  # FedAvg-Z's too
    base = {**steps, **PAPER_DPO}
    held = {"learn_inducing_sd": False}
    variants = [
        ("default", "dpo", args.rounds, {}),
        ("init_precision=1", "dpo", args.rounds, {"init_precision": 1.0}),
        ("rounds x3", "dpo", 3 * args.rounds, {}),
        ("Z at the data", "dpo", args.rounds, {"fixed_inducing": Z0}),
        ("adam 0.05", "dpo", args.rounds, {"optimizer": optax.adam(0.05)}),
        ("pseudo_fraction=1", "dpo", args.rounds, {"pseudo_fraction": 1.0}),
        ("pseudo_fraction=1, init_precision=1", "dpo", args.rounds,
         {"pseudo_fraction": 1.0, "init_precision": 1.0}),
        ("covariance=noise", "dpo", args.rounds, {"covariance": "noise"}),
        ("Z at the data, covariance=noise", "dpo", args.rounds,
         {"fixed_inducing": Z0, "covariance": "noise"}),
        ("init_inducing=pseudo-inputs", "dpo", args.rounds, {"init_inducing": "pseudo-inputs"}),
        ("num_samples=8", "dpo", args.rounds, {"num_samples": 8}),
        ("alpha=1", "dpo", args.rounds, {"alpha": 1.0}),
        ("alpha=0", "dpo", args.rounds, {"alpha": 0.0}),
        ("fedavg-z", "fedavg-z", args.rounds, {}),
        ("global, Z at the data", "global", args.global_rounds, {"fixed_inducing": Z0}),
        ("global", "global", args.global_rounds, {}),
        ("sd held at 0.1", "dpo", args.rounds, held),
        ("sd held at 0.1, alpha=0.01", "dpo", args.rounds, {**held, "alpha": 0.01}),
        ("sd held at 0.1, alpha=0.01, covariance=noise", "dpo", args.rounds,
         {**held, "alpha": 0.01, "covariance": "noise"}),
        ("sd held at 0.01, alpha=0", "dpo", args.rounds,
         {**held, "alpha": 0.0, "inducing_precision": 1e4}),
        ("sd held at 0.01, alpha=0, covariance=noise", "dpo", args.rounds,
         {**held, "alpha": 0.0, "inducing_precision": 1e4, "covariance": "noise"}),
    ]
    if args.only:
        unknown = set(args.only) - {v[0] for v in variants}
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; choose from "
                             f"{[v[0] for v in variants]}")
        variants = [v for v in variants if v[0] in args.only]
    rows = []
    for name, method, rounds, extra in variants:
        t0 = time.perf_counter()
        r = sgp_uci.fit_one(method, prep, rounds, SGPConfig(**{**base, **extra}),
                            keep_result=True)
        fe = np.asarray(r["history"]["free_energy"])
        state = r["result"].state
        log_beta, _ = g.to_moments(sgp_pvi.q_beta(state))
        z_sd = (float(np.median(np.sqrt(g.to_moments(sgp_pvi.q_z(state))[1])))
                if method in ("dpo", "cpo") and "fixed_inducing" not in extra else None)
        row = {"variant": name, "method": method, "rounds": rounds,
               "free_energy": float(fe[-1]),
               "free_energy_change_last_10": float(fe[-1] - fe[-10]) if len(fe) >= 10 else None,
               "log_lik": r["log_lik"], "rmse": r["rmse"],
               "noise_sd": float(np.exp(log_beta[-1])), "q_z_sd_median": z_sd,
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{name}: free energy {row['free_energy']:.1f} "
              f"(last 10 rounds {row['free_energy_change_last_10']:+.1f}), "
              f"test log-lik {row['log_lik']:.3f}, RMSE {row['rmse']:.3f}, "
              f"noise sd {row['noise_sd']:.3f}, q(Z) sd {z_sd}, "
              f"{row['seconds']:.0f} s", flush=True)
    lines = [f"| {args.data} split {args.split}: variant | rounds | free energy | change over "
             "the last 10 rounds | test log-lik | test RMSE | noise sd | q(Z) sd, median |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['rounds']} | {r['free_energy']:.1f} | "
              f"{r['free_energy_change_last_10']:+.1f} | {r['log_lik']:.3f} | {r['rmse']:.3f} | "
              f"{r['noise_sd']:.3f} | "
              + ("-" if r["q_z_sd_median"] is None else f"{r['q_z_sd_median']:.3f}") + " |"
              for r in rows]
    text = "\n".join(lines)
    print("\n" + text)
    out = args.out or Path(__file__).parent / "results" / f"sgp_dpo_diagnosis_{args.data}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamp({
        "what": "DPO against global VI, one change at a time (sequential, K = 10, M = 100)",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__},
        "rows": rows, "table_markdown": text}), indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
