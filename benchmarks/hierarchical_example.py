"""The hierarchical page's example as written (docs/guide/hierarchical.md: a random-intercept
regression, 30 groups on six clients holding 1 to 11 each, numbered from 0 at each client, the
group effects local), against NUTS on the pooled data (the groups numbered across clients).

The page's code cells run as they are, in JAX's default float32 (``--x64``: float64): PVI with
a full-rank guide for 10 rounds, then ``result.refine(key, clients)`` with its defaults (the
SMC sampler, since the model has local sites). Reported per global site: the error of the mean
in NUTS sds and the sd ratio, for PVI and for the refined answer, beside the refinement's own
Monte Carlo error (``mcse``, in NUTS sds) and ``local_sd``; and for a group client 0 does not
hold, its draws against NUTS's posterior of a group without data (one more, empty group).

Run::

    python benchmarks/hierarchical_example.py
    python benchmarks/hierarchical_example.py --x64 \\
        --out benchmarks/results/hierarchical_example_f64.json

Prints a table and writes JSON to ``--out`` (default
benchmarks/results/hierarchical_example.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import jax
import numpy as np
import numpyro
from _provenance import stamp
from numpyro.infer import MCMC, NUTS

BENCHMARK = {
    "summary": ("the hierarchical page's example as written, in float32, against pooled NUTS: PVI "
                "and refine's errors in the global and local sites"),
    "data": None,
    "quick": ["--ref-samples", "200", "--draws", "500"],
    "full": [[]],
    "cost": "quick ~1.5 min; full ~6 min",
}

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guide" / "hierarchical.md"
GLOBAL = ("mu_a", "sigma_a", "b", "sigma_y")


def page_cells(path: Path = PAGE) -> list[str]:
    """The page's executed code cells, in order."""
    return re.findall(r"```\{code-cell\} ipython3\n(.*?)```", path.read_text(), re.S)


def errors(draws: dict, ref: dict) -> dict[str, tuple[float, float]]:
    """Per global coordinate (``b[0]``...): |mean - NUTS mean| / NUTS sd, and sd / NUTS sd."""
    out = {}
    for k in GLOBAL:
        m, s = np.atleast_1d(draws[k].mean(0)), np.atleast_1d(draws[k].std(0))
        M, S = np.atleast_1d(ref[k].mean(0)), np.atleast_1d(ref[k].std(0))
        for i in range(len(m)):
            name = k if np.ndim(ref[k]) == 1 else f"{k}[{i}]"
            out[name] = (float(abs(m[i] - M[i]) / S[i]), float(s[i] / S[i]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--x64", action="store_true", help="float64 (default: float32)")
    ap.add_argument("--ref-samples", type=int, default=5000)
    ap.add_argument("--draws", type=int, default=8000)
    ap.add_argument("--out", default="benchmarks/results/hierarchical_example.json")
    args = ap.parse_args()
    jax.config.update("jax_enable_x64", args.x64)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    results: dict = {
        "command": " ".join(sys.argv), "date": date.today().isoformat(), "commit": commit,
        "settings": vars(args), "dtype": "float64" if args.x64 else "float32",
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "device": str(jax.devices()[0]), "jax": jax.__version__,
                    "numpyro": numpyro.__version__}}
    ns: dict = {}
    code = "\n".join(page_cells())
    fit_code, refine_code = code.split("refined = ", 1)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(fit_code, ns)  # the page's own example
    results["fit_seconds"] = time.perf_counter() - t0
    results["fit_warnings"] = [str(w.message)[:200] for w in seen]
    t0 = time.perf_counter()
    exec("refined = " + refine_code, ns)
    results["refine_seconds"] = time.perf_counter() - t0
    result, refined, data, model = ns["result"], ns["refined"], ns["data"], ns["model"]

    starts = np.cumsum([0] + [len(np.unique(g)) for _, g, _ in data])
    pooled = [np.concatenate(a) for a in zip(*[(X, g + s, y) for (X, g, y), s
                                                in zip(data, starts, strict=False)], strict=True)]
    groups = int(starts[-1])
    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=args.ref_samples, num_chains=2,
                chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.key(5), *pooled, n_groups=groups + 1)
    ref = {k: np.asarray(v) for k, v in mcmc.get_samples().items()}
    results["nuts_seconds"] = time.perf_counter() - t0
    key = jax.random.key(9)
    np_draws = {k: np.asarray(v) for k, v in result.sample(key, args.draws).items()}
    pvi_err = errors(np_draws, ref)
    smc_err = errors({k: np.asarray(v) for k, v in refined.sample(key, args.draws).items()}, ref)
    results["rows"] = [{"site": k, "pvi_mean_error": pvi_err[k][0], "pvi_sd_ratio": pvi_err[k][1],
                        "refined_mean_error": smc_err[k][0], "refined_sd_ratio": smc_err[k][1]}
                       for k in pvi_err]
    unheld = np.asarray(result.sample(key, args.draws, client=0)["a"][:, 1:])
    new = ref["a"][:, -1]
    _, cov = refined.mean_and_cov()
    sd = np.sqrt(np.diag(np.asarray(cov)))
    results["runs"] = [{
        "dtype": results["dtype"], "fit_seconds": results["fit_seconds"],
        "refine_seconds": results["refine_seconds"], "refined_rounds": refined.num_rounds,
        "pvi_worst_mean_error": max(e[0] for e in pvi_err.values()),
        "pvi_worst_sd_error": max(abs(e[1] - 1) for e in pvi_err.values()),
        "refined_worst_mean_error": max(e[0] for e in smc_err.values()),
        "refined_worst_sd_error": max(abs(e[1] - 1) for e in smc_err.values()),
        "refined_mcse_in_sd": float(np.max(refined.mcse()["mean"] / sd)),
        "local_sd": float(refined.local_sd),
        "new_group_mean_error": float(abs(unheld.mean() - new.mean()) / new.std()),
        "new_group_sd_ratio": float(unheld.std() / new.std())}]
    results["chosen"] = refined.chosen
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(results), indent=1))
    run = results["runs"][0]
    print(f"\n{results['dtype']}: PVI {run['fit_seconds']:.0f} s, refine "
          f"{run['refine_seconds']:.0f} s ({refined.num_rounds} rounds), NUTS "
          f"{results['nuts_seconds']:.0f} s")
    print("| site | PVI mean err (sd) | PVI sd ratio | refined mean err (sd) | refined sd ratio |")
    print("|---|---|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['site']} | {row['pvi_mean_error']:.3f} | {row['pvi_sd_ratio']:.3f} | "
              f"{row['refined_mean_error']:.3f} | {row['refined_sd_ratio']:.3f} |")
    print(f"refined mcse (sd) {run['refined_mcse_in_sd']:.3f}, local_sd {run['local_sd']:.2f}; "
          f"a group client 0 does not hold: mean err {run['new_group_mean_error']:.3f} sd, "
          f"sd ratio {run['new_group_sd_ratio']:.3f}")

if __name__ == "__main__":
    main()
