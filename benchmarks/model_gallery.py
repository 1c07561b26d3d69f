"""fedppl's federated inference on the model gallery, against NUTS and pooled Gaussian VI.

For every model of :mod:`examples.gallery` (K = 10 clients with uneven sizes and shifted
covariates), this computes the pooled references of :mod:`gallery_references` (NUTS, and SVI with
the same Gaussian family as the federated guide), then runs fedppl's PVI (:func:`run_fedppl`) and
reports, for the global sites, the worst mean error in reference posterior sds and the worst sd
ratio (max of r and 1/r) against NUTS and against pooled SVI, the number of rounds and the wall
time. For models with local sites (the hierarchical ones, one group per client), client k's local
draws are compared with group k of the pooled references; the worst client is reported.

Models fedppl does not handle yet (local sites, non-Gaussian priors, ...) raise inside
:func:`run_fedppl`; the error is recorded in that model's row and the run goes on.

Run::

    python benchmarks/model_gallery.py                          # all models, full references
    python benchmarks/model_gallery.py --quick --models poisson_regression
    python benchmarks/model_gallery.py --schedule synchronous --repeats 3
    python benchmarks/model_gallery.py --method ep --schedule synchronous --rounds 15 \
        --models logistic_laplace,hierarchical_logistic,negbin_regression \
        --out benchmarks/results/model_gallery_ep.json     # also --method ep-stein
    python benchmarks/model_gallery.py --refine 10 --smc   # and the check, refine, the sampler

Prints a markdown table and writes JSON (machine, settings, one row per model) to ``--out``
(default ``benchmarks/results/model_gallery.json``; ``model_gallery_quick.json`` with
``--quick``). References are cached (see :mod:`gallery_references`), so a second run only re-runs
fedppl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import numpyro

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gallery_references as refs  # noqa: E402  (sets jax_enable_x64, puts the repo on the path)
from _provenance import stamp  # noqa: E402

from examples.gallery import GALLERY, Entry  # noqa: E402

BENCHMARK = {
    "summary": ("fedppl on the fourteen gallery models against pooled NUTS and pooled Gaussian VI "
                "(worst mean and sd errors, rounds, seconds); EP and refine on the gallery"),
    "data": None,
    "quick": ["--quick", "--models", "poisson_regression"],
    "full": [[],
             ["--method", "ep", "--schedule", "synchronous", "--rounds", "15", "--models",
              "logistic_laplace,hierarchical_logistic,negbin_regression", "--out",
              "benchmarks/results/model_gallery_ep.json"],
             ["--models", "hierarchical_intercept,hierarchical_logistic", "--refine", "10",
              "--smc", "--out", "benchmarks/results/model_gallery_smc.json"]],
    "cost": "quick ~2 min; full ~1 h (with uncached references)",
}

OUT = HERE / "results" / "model_gallery.json"
QUICK_OUT = HERE / "results" / "model_gallery_quick.json"
NUM_ROUNDS, TOL, DAMPING, NUM_DRAWS = 30, 1e-8, 1.0, 20000


def run_fedppl(entry: Entry, clients_arrays, model_kwargs: dict, schedule: str,
               num_rounds: int = NUM_ROUNDS, repeats: int = 1, method: str = "pvi",
               refine: int = 0, refine_draws: int = 2000, smc: bool = False) -> dict:
    """Federated PVI (or EP, ``method="ep"``: full-rank sites, its default NUTS and decaying
    damping, ``num_rounds`` rounds; ``"ep-stein"``: with Stein's estimator) on the clients:
    global draws, client k's local draws, rounds and seconds. ``repeats`` re-runs the same
    (already compiled) object to time it.
    """
    import fedppl
    from fedppl.guides import PVIGuide

    clients = fedppl.Clients.from_list(clients_arrays)
    ep = method.startswith("ep")
    family = "fullrank" if ep else entry.family
    guide = PVIGuide(entry.model, global_sites=entry.global_sites, family=family)
    front = (fedppl.EP(entry.model, guide, schedule,
                       estimator="stein" if method == "ep-stein" else "sample") if ep else
             fedppl.PVI(entry.model, guide, schedule=schedule, damping=DAMPING))
    tol = None if ep else TOL  # EP's q moves by its Monte Carlo noise every round
    runs = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        result = front.run(jax.random.key(0), clients, num_rounds=num_rounds, tol=tol,
                           progress_bar=False, **model_kwargs)
        runs.append(time.perf_counter() - t0)
    draws = {s: np.asarray(v) for s, v in result.sample(jax.random.key(1), NUM_DRAWS).items()}
    local = {}
    if entry.global_sites is not None:
        for k in range(clients.num_clients):
            d = result.sample(jax.random.key(1), NUM_DRAWS, client=k)
            local[k] = {s: np.asarray(v) for s, v in d.items() if s not in entry.global_sites}
    history = result.history
    out = {"draws": draws, "local": local, "rounds": len(history["seconds"]),
           "seconds_first": runs[0],
           "seconds": statistics.median(runs[1:] if len(runs) > 1 else runs),
           "round_seconds": float(np.sum(history["seconds"])),
           "rejected": len(result.rejected), "unconverged": len(result.unconverged)}
    if refine:
        out.update(_refine(result, clients, model_kwargs, refine, refine_draws))
    if smc:
        out.update(_sample(result, clients, model_kwargs))
    return out


def _sample(result, clients, model_kwargs: dict) -> dict:
    """The federated SMC sampler from a result (``refine(method="smc")`` with its defaults):
    its draws, rounds, seconds and own diagnostics (reached, renewed, stated Monte Carlo error
    of the means in the particles' sds, ``local_sd``); an error is recorded instead."""
    t0 = time.perf_counter()
    try:
        out = result.refine(jax.random.key(2), clients, method="smc", progress_bar=False,
                            warn=False, **model_kwargs)
    except Exception as exc:
        return {"smc_error": f"{type(exc).__name__}: {exc}".strip()[:500]}
    draws = {s: np.asarray(v) for s, v in out.sample(jax.random.key(3), NUM_DRAWS).items()}
    _, cov = out.mean_and_cov()
    return {"smc_draws": draws, "smc_rounds": out.num_rounds, "smc_reached": out.reached,
            "smc_renewed": out.renewed, "smc_local_sd": out.local_sd,
            "smc_stated_mcse": float(np.max(out.mcse()["mean"] / np.sqrt(np.diag(cov)))),
            "smc_seconds": time.perf_counter() - t0}


def _refine(result, clients, model_kwargs: dict, num_rounds: int, num_draws: int) -> dict:
    """The check (its k-hat) and the refinement of a result: k-hat, ESS, rounds, seconds and
    resampled draws; an error is recorded instead."""
    t0 = time.perf_counter()
    try:
        imp = result.refine(jax.random.key(2), clients, num_rounds=num_rounds,
                            method="importance",
                            num_draws=num_draws, progress_bar=False, warn=False, **model_kwargs)
    except Exception as exc:
        return {"refine_error": f"{type(exc).__name__}: {exc}".strip()[:500]}
    draws = {s: np.asarray(v) for s, v in imp.sample(jax.random.key(3), NUM_DRAWS).items()}
    return {"refined_draws": draws, "khat_check": float(imp.history["khat"][0]),
            "ess_check": float(imp.history["ess"][0]), "khat_refined": imp.khat,
            "ess_refined": imp.ess, "refine_rounds": imp.num_rounds, "refine_draws": num_draws,
            "refine_seconds": time.perf_counter() - t0}


def _client_slice(values: np.ndarray, k: int, group_shape: tuple[int, ...]) -> np.ndarray:
    """Client k's part of a local site's draws, whether fedppl returns the whole group plate,
    just client k's group, or client k's group with a length-1 plate axis."""
    if values.shape[1:] == group_shape:
        return values
    if values.ndim >= 2 and values.shape[2:] == group_shape:
        return values[:, k] if values.shape[1] > k else values[:, 0]
    raise ValueError(f"local draws of shape {values.shape[1:]}, expected {group_shape} per group")


def _local_comparison(entry: Entry, local: dict, reference: dict) -> dict:
    """Worst (over clients) comparison of client k's local sites with group k of the reference."""
    local_sites = [s for s in reference if s not in entry.global_sites]
    worst = None
    for k, d in local.items():
        ref_k = refs.local_reference(reference, local_sites, k)
        mine = {s: _client_slice(np.asarray(d[s]), k, ref_k[s].shape[1:]) for s in ref_k if s in d}
        if not mine:
            continue
        c = refs.compare(mine, ref_k)
        c["mean_at"], c["sd_at"] = f"client {k}: {c['mean_at']}", f"client {k}: {c['sd_at']}"
        if worst is None:
            worst = dict(c)
        else:
            if c["mean_error"] > worst["mean_error"]:
                worst["mean_error"], worst["mean_at"] = c["mean_error"], c["mean_at"]
            if c["sd_ratio"] > worst["sd_ratio"]:
                worst["sd_ratio"], worst["sd_at"] = c["sd_ratio"], c["sd_at"]
            worst["coordinates"] += c["coordinates"]
    return worst


def evaluate(entry: Entry, args) -> dict:
    clients_arrays, model_kwargs = entry.make_data(args.data_seed)
    pooled_args, full_kwargs = refs.pooled(clients_arrays), refs.full_data_kwargs(model_kwargs)
    sites = refs.latent_sites(entry.model, pooled_args, full_kwargs)
    globals_ = list(sites) if entry.global_sites is None else list(entry.global_sites)
    row = {"model": entry.name, "family": entry.family, "description": entry.description,
           "num_data": int(sum(len(c[0]) for c in clients_arrays)),
           "client_sizes": [len(c[0]) for c in clients_arrays],
           "sites": {s: list(v) for s, v in sites.items()},
           "global_sites": globals_, "local_sites": [s for s in sites if s not in globals_],
           "model_kwargs": {k: v for k, v in model_kwargs.items()}}
    nuts, row["nuts"] = refs.nuts_reference(entry, 0, data_seed=args.data_seed, quick=args.quick,
                                            with_info=True)
    svi, row["svi"] = refs.svi_reference(entry, 0, data_seed=args.data_seed, quick=args.quick,
                                         with_info=True)
    row["svi_vs_nuts"] = refs.compare(svi, nuts)
    t0 = time.perf_counter()
    try:
        fed = run_fedppl(entry, clients_arrays, model_kwargs, args.schedule, args.rounds,
                         args.repeats, args.method, args.refine, args.refine_draws, args.smc)
    except Exception as exc:  # the fedppl API is still growing: record and go on
        row["error"] = f"{type(exc).__name__}: {exc}".strip()[:500]
        row["seconds_to_error"] = time.perf_counter() - t0
        return row
    row.update({k: fed[k] for k in ("rounds", "seconds", "seconds_first", "round_seconds",
                                    "rejected", "unconverged")})
    nuts_g = {s: nuts[s] for s in globals_}
    svi_g = {s: svi[s] for s in globals_}
    row["vs_nuts"] = refs.compare(fed["draws"], nuts_g)
    row["vs_svi"] = refs.compare(fed["draws"], svi_g)
    for key in ("khat_check", "ess_check", "khat_refined", "ess_refined", "refine_rounds",
                "refine_draws", "refine_seconds", "refine_error"):
        if key in fed:
            row[key] = fed[key]
    if "refined_draws" in fed:
        row["refined_vs_nuts"] = refs.compare(fed["refined_draws"], nuts_g)
    for key in ("smc_rounds", "smc_reached", "smc_renewed", "smc_local_sd", "smc_stated_mcse",
                "smc_seconds", "smc_error"):
        if key in fed:
            row[key] = fed[key]
    if "smc_draws" in fed:
        row["smc_vs_nuts"] = refs.compare(fed["smc_draws"], nuts_g)
    if fed["local"]:
        row["local_vs_nuts"] = _local_comparison(entry, fed["local"], nuts)
        row["local_vs_svi"] = _local_comparison(entry, fed["local"], svi)
    return row


def _fmt(c: dict | None) -> str:
    return "-" if not c else f"{c['mean_error']:.3f} / {c['sd_ratio']:.3f}"


def print_table(rows: list[dict]) -> None:
    print("\nmean error (reference sds) / sd ratio, global sites; local: worst client's groups\n")
    print("| model | family | rounds | s (median) | vs NUTS | vs SVI | local vs NUTS "
          "| local vs SVI | SVI vs NUTS | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = r.get("error", "")
        err = (err[:70] + "...") if len(err) > 70 else err
        secs = f"{r['seconds']:.2f}" if "seconds" in r else "-"
        print(f"| {r['model']} | {r['family']} | {r.get('rounds', '-')} | {secs} "
              f"| {_fmt(r.get('vs_nuts'))} | {_fmt(r.get('vs_svi'))} "
              f"| {_fmt(r.get('local_vs_nuts'))} | {_fmt(r.get('local_vs_svi'))} "
              f"| {_fmt(r['svi_vs_nuts'])} | {err} |")
    refined = [r for r in rows if "khat_check" in r or "refine_error" in r]
    if refined:
        print("\ncheck and refine (global sites vs NUTS: mean error / sd ratio)\n")
        print("| model | PVI vs NUTS | check k-hat | refined vs NUTS | refined k-hat | ESS | "
              "rounds | s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in refined:
            if "refine_error" in r:
                print(f"| {r['model']} | {_fmt(r.get('vs_nuts'))} | error: "
                      f"{r['refine_error'][:60]} | | | | | |")
                continue
            print(f"| {r['model']} | {_fmt(r.get('vs_nuts'))} | {r['khat_check']:.2f} "
                  f"| {_fmt(r['refined_vs_nuts'])} | {r['khat_refined']:.2f} "
                  f"| {r['ess_refined']:.0f} | {r['refine_rounds']} "
                  f"| {r['refine_seconds']:.1f} |")


    sampled = [r for r in rows if "smc_rounds" in r or "smc_error" in r]
    if sampled:
        print("\nthe SMC sampler (refine(method='smc'), global sites vs NUTS: mean error / sd "
              "ratio; its stated Monte Carlo error of the means, in sds)\n")
        print("| model | PVI vs NUTS | SMC vs NUTS | stated MC error | reached, renewed "
              "| local sd | rounds | s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in sampled:
            if "smc_error" in r:
                print(f"| {r['model']} | {_fmt(r.get('vs_nuts'))} | error: "
                      f"{r['smc_error'][:60]} | | | | | |")
                continue
            print(f"| {r['model']} | {_fmt(r.get('vs_nuts'))} | {_fmt(r['smc_vs_nuts'])} "
                  f"| {r['smc_stated_mcse']:.3f} | {r['smc_reached']}, {r['smc_renewed']:.2f} "
                  f"| {r['smc_local_sd']:.2f} | {r['smc_rounds']} | {r['smc_seconds']:.1f} |")


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or None,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "numpyro": numpyro.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "x64": bool(jax.config.jax_enable_x64),
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS")}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated gallery names (default all)")
    p.add_argument("--quick", action="store_true", help="short NUTS and SVI references")
    p.add_argument("--schedule", choices=("sequential", "synchronous"), default="sequential")
    p.add_argument("--rounds", type=int, default=NUM_ROUNDS)
    p.add_argument("--repeats", type=int, default=1, help="fedppl runs to time (median)")
    p.add_argument("--method", choices=("pvi", "ep", "ep-stein"), default="pvi",
                   help="fedppl.PVI (default) or fedppl.EP (with estimator='stein')")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--refine", type=int, default=0, metavar="R",
                   help="also check each answer and refine it for up to R rounds "
                        "(result.refine: k-hat, ESS, refined errors against NUTS)")
    p.add_argument("--refine-draws", type=int, default=2000, help="S per refine round")
    p.add_argument("--smc", action="store_true",
                   help="also run the federated SMC sampler from each answer "
                        "(refine(method='smc'), its defaults) against NUTS")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON path (default {OUT.name}, or {QUICK_OUT.name} with --quick)")
    args = p.parse_args(argv)
    args.out = args.out or (QUICK_OUT if args.quick else OUT)
    names = args.models.split(",") if args.models else list(GALLERY)
    unknown = [n for n in names if n not in GALLERY]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(GALLERY)}")
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = evaluate(GALLERY[name], args)
        status = row.get("error") or (f"{row['rounds']} rounds, vs NUTS {_fmt(row['vs_nuts'])}")
        print(f"{name}: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
        rows.append(row)
    print_table(rows)
    settings = {"method": args.method, "schedule": args.schedule, "num_rounds": args.rounds,
                "tol": TOL if args.method == "pvi" else None,
                "damping": DAMPING, "num_draws": NUM_DRAWS, "repeats": args.repeats,
                "quick": args.quick, "data_seed": args.data_seed, "num_clients": 10,
                "refine_rounds": args.refine, "refine_draws": args.refine_draws,
                "smc": args.smc,
                "nuts": refs.NUTS_QUICK if args.quick else refs.NUTS_SETTINGS,
                "svi": refs.SVI_QUICK if args.quick else refs.SVI_SETTINGS,
                "timing": "seconds: median wall time of PVI.run over the repeats after the first "
                          "(the first, with compilation, when repeats=1); seconds_first: the first"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp(_jsonable({"machine": machine(), "settings": settings,
                                                     "rows": rows})), indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
