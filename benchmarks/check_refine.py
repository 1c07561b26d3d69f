"""The federated importance check and its refinement against pooled NUTS
(``PVIResult.check`` and ``PVIResult.refine``).

A run of :class:`fedppl.PVI` (full-rank guide) is checked in one more round: the server sends
``S`` (``--num-draws``) draws of the global sites from q (fedppl's ``first_df``, default inf;
earlier versions drew from a t with q's moments: ``fedppl_sources`` in the JSON says which
sources were measured), every client returns its log-likelihood at each draw (with local
sites: its log marginal likelihood by Laplace importance sampling), and PSIS gives Pareto
k-hat, the effective sample size (ESS) and importance-corrected moments. ``refine`` repeats
the exchange (round 1 is the check, with the same key: the same draws), each round proposing
from a t fitted to the weighted draws so far, until k-hat < 0.5 and ESS >= ``--ess-target``
(fedppl's default, 2000; the committed runs before that default name theirs) or
``--refine-rounds``.

Measured, for PVI's q, the check's corrected moments and refine's, over the flat unconstrained
global vector against pooled NUTS:

* ``mean_err``: the worst ``|mean - mean_ref| / sd_ref``; ``sd_err``: the worst
  ``|sd / sd_ref - 1|`` (``ep_vs_pvi.errors``);
* the method's own diagnostic beside them: k-hat, ESS, ``reliable`` (k-hat below
  ``min(1 - 1/log10(N), 0.7)``);
* ``worst_z``: the worst ``|mean - mean_ref| / se`` with the Monte Carlo error
  ``se = sqrt(mcse^2 + sd_ref^2 / ESS_ref)``: ``mcse`` the delta-method standard error of each
  coordinate of the weighted mean (``ImportanceResult.mcse``'s formula, recomputed here for
  every round), ``ESS_ref`` the reference's per-coordinate NUTS ESS (infinite when the
  reference is read from a file). ``within_mc`` when every coordinate is within 3 se; None when
  k-hat is above the reliability threshold, where the Monte Carlo error means nothing.
  ``1/sqrt(ESS)`` is the error of a mean in posterior sd that the PSIS ESS alone suggests; the
  sd's own Monte Carlo error is about ``1 / sqrt(2 ESS)`` for a Gaussian (``sd_mc``);
* rounds, draws per round ``S``, seconds per round (``history["seconds"]``: the exchange,
  clients' work; and wall seconds of the whole call), bytes up; ``local_sd`` (nats: the sd
  of the clients' local-site estimates where the weight is) where this fedppl reports it.

Per round of refine (``refine_rounds`` in the JSON): k-hat, ESS and the errors of the moments
the rounds so far give, recomputed from refine's result without another exchange (its draws,
proposals and the pooled log density ``log_ratios + log mixture``: each round's AMIS
re-weighting by the mixture of the proposals up to it; round 1 must equal the check,
``replay_matches_check``).

Tasks:

* ``--task hierarchical``: ``benchmarks/ep_hierarchical.py``'s simulation (J = 40 groups,
  D = 20, K = 25 clients, 42 global coordinates ``(mu, log sigma)``, local random effects).
  PVI with ``PVIGuide(model, ("mu", "sigma"), family="fullrank")``, its defaults otherwise
  (sequential, damping 1; ``elbo_samples=0``: the ELBO diagnostic only), ``--pvi-rounds`` 20.
  Reference: pooled NUTS (``ep_hierarchical.pooled_nuts``, 4 x ``--ref-samples``), or
  ``--reference-from benchmarks/results/ep_hierarchical.json`` (its ``seeds[i]["reference"]``
  with the same seed, D and K).
* ``--task breast-cancer``: ``benchmarks/ep_vs_pvi.py``'s logistic regression (31 coordinates,
  80% training split homogeneously over ``--clients`` K), PVI full rank as there (synchronous,
  damping 0.5, ``elbo_samples=0``), 20 rounds; reference ``ep_vs_pvi.pooled_nuts`` (dense mass,
  4 x ``--ref-samples``).

Run (pinned to one core here)::

    python benchmarks/check_refine.py --task hierarchical
    python benchmarks/check_refine.py --task hierarchical \\
        --reference-from benchmarks/results/ep_hierarchical.json
    python benchmarks/check_refine.py --task breast-cancer --clients 10
    python benchmarks/check_refine.py --task breast-cancer --clients 100
    python benchmarks/check_refine.py --task breast-cancer --clients 10 --ess-target 1e9 \
        --out benchmarks/results/check_refine_breast_cancer_k10_all_rounds.json  # no early stop
    python benchmarks/check_refine.py --task hierarchical --quick     # a smoke run

Prints a table and writes JSON to ``--out`` (default
``benchmarks/results/check_refine_<task>.json``; ``_k<K>`` added for breast cancer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.diagnostics import effective_sample_size

import fedppl
from fedppl.algorithms import importance as imp
from fedppl.infer.importance import khat_threshold

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ep_hierarchical as hier
import ep_vs_pvi as bc
from _provenance import stamp
from ep_vs_pvi import errors

BENCHMARK = {
    "summary": ("the federated importance check (Pareto k-hat) and refine against pooled NUTS: a "
                "hierarchical logistic regression with local sites, breast cancer at K = 10 and "
                "100"),
    "data": None,
    "quick": ["--task", "breast-cancer", "--quick"],
    "full": [["--task", "hierarchical"],
             ["--task", "breast-cancer", "--clients", "10"],
             ["--task", "breast-cancer", "--clients", "100"],
             ["--task", "breast-cancer", "--clients", "10", "--ess-target", "1e9", "--out",
              "benchmarks/results/check_refine_breast_cancer_k10_all_rounds.json"]],
    "cost": "quick ~1 min (breast cancer; the hierarchical smoke run takes over 3); full ~1.5 h",
}

jax.config.update("jax_enable_x64", True)


def nuts_ess(draws: np.ndarray, num_chains: int = 4) -> np.ndarray:
    """Per-coordinate ESS of flat draws ``(chains * n, D)`` stored chain after chain."""
    return np.asarray(effective_sample_size(draws.reshape(num_chains, -1, draws.shape[1])))


def weighted_mcse(draws: np.ndarray, log_weights: np.ndarray) -> np.ndarray:
    """Monte Carlo standard error of each coordinate of a self-normalised importance mean (the
    delta method: ``sqrt(sum_i w_i^2 (x_i - mean)^2)``, ``ImportanceResult.mcse``'s formula)."""
    w = np.exp(log_weights - np.max(log_weights))
    w = w / w.sum()
    return np.sqrt((w**2) @ (draws - w @ draws) ** 2)


def scores(mean, cov, ref_mean, ref_sd, ref_ess, ess=None, mcse=None) -> dict:
    """Errors against the reference and, for importance moments (``ess``, ``mcse``), Monte
    Carlo z's: ``|mean - mean_ref| / sqrt(mcse^2 + sd_ref^2 / ESS_ref)``."""
    mean, cov = np.asarray(mean), np.asarray(cov)
    me, se = errors(mean, cov, ref_mean, ref_sd)
    out = {"mean_err": me, "sd_err": se}
    if ess is not None:
        mc = np.sqrt(mcse**2 + ref_sd**2 / ref_ess)
        z = np.abs(mean - ref_mean) / mc
        out.update(worst_z=float(z.max()), beyond_2se=int(np.sum(z > 2)),
                   within_mc=bool(z.max() <= 3), mean_mc=float(1 / np.sqrt(ess)),
                   worst_mcse=float(np.max(mcse / ref_sd)), sd_mc=float(1 / np.sqrt(2 * ess)))
    return out


def replay(result, ref_mean, ref_sd, ref_ess) -> list[dict]:
    """k-hat, ESS and errors after each round of an ImportanceResult, from its own draws: the
    pooled log density is ``log_ratios + log mixture(all proposals)``; round r re-weights the
    first r rounds' draws by the mixture of the first r proposals (what refine computed)."""
    props = list(result.proposals)
    R, draws = len(props), np.asarray(result.draws)
    S = len(draws) // R
    log_g = np.asarray(imp.mixture_log_prob(props, [S] * R, jnp.asarray(draws)), np.float64)
    log_target = result.log_ratios + log_g
    rows = []
    for r in range(1, R + 1):
        n = r * S
        log_g_r = np.asarray(imp.mixture_log_prob(props[:r], [S] * r, jnp.asarray(draws[:n])),
                             np.float64)
        lw, khat = imp.psis(log_target[:n] - log_g_r)
        ess = imp.ess(lw)
        m, c = imp.weighted_moments(draws[:n], lw)
        row = {"round": r, "draws": n, "khat": float(khat), "ess": float(ess),
               "reliable": bool(khat <= khat_threshold(n)),
               "seconds": float(result.history["seconds"][r - 1])}
        if "local_sd" in result.history:
            row["local_sd"] = float(result.history["local_sd"][r - 1])
        row.update(scores(m, c, ref_mean, ref_sd, ref_ess, ess, weighted_mcse(draws[:n], lw)))
        if not row["reliable"]:
            row["within_mc"] = None
        rows.append(row)
    return rows


def importance_row(result, wall: float, ref_mean, ref_sd, ref_ess, caught) -> dict:
    h = result.history
    row = {"rounds": len(h["round"]), "draws_per_round": len(result.draws)
           // len(result.proposals), "draws": len(result.draws), "khat": float(result.khat),
           "ess": float(result.ess), "threshold": float(result.threshold),
           "reliable": bool(result.reliable), "wall_seconds": wall,
           "seconds_per_round": float(np.median(h["seconds"])),
           "seconds_rounds": np.asarray(h["seconds"], float).tolist(),
           "bytes_up": int(np.sum(h["bytes_up"])), "bytes_down": int(np.sum(h["bytes_down"])),
           "messages_up": int(np.sum(h["messages_up"])),
           "warnings": [str(w.message) for w in caught]}
    if hasattr(result, "local_sd"):  # fedppl versions whose clients send their estimates' sd
        row["local_sd"] = float(result.local_sd)
    m, c = result.mean_and_cov()
    mcse = weighted_mcse(np.asarray(result.draws), np.asarray(result.log_weights))
    if hasattr(result, "mcse"):  # fedppl's own, where this version has it
        row["mcse_matches_fedppl"] = bool(np.allclose(mcse, result.mcse()))
    row.update(scores(m, c, ref_mean, ref_sd, ref_ess, result.ess, mcse))
    row.update(mean=np.asarray(m).tolist(), sd=np.sqrt(np.diag(np.asarray(c))).tolist())
    if not result.reliable:  # k-hat says the ESS (and so the Monte Carlo error) is meaningless
        row["within_mc"] = None
    return row


def check_and_refine(res, clients, key, args, ref_mean, ref_sd, ref_ess) -> dict:
    """PVI's q, its check and its refinement, scored; check and refine share ``key``."""
    out: dict = {}
    settings = {} if args.local_draws is None else {"local_draws": args.local_draws}
    m, c = res.mean_and_cov()
    out["PVI q"] = scores(m, c, ref_mean, ref_sd, ref_ess) | {
        "rounds": int(res.num_rounds),
        "seconds_per_round": float(np.median(res.history["seconds"][1:]))
        if res.num_rounds > 1 else float("nan"),
        "seconds_rounds": np.asarray(res.history["seconds"], float).tolist()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        t0 = time.perf_counter()
        chk = res.check(key, clients, num_draws=args.num_draws, **settings)
        wall = time.perf_counter() - t0
    out["check"] = importance_row(chk, wall, ref_mean, ref_sd, ref_ess, caught)
    print(f"  check: k-hat {chk.khat:.2f}, ESS {chk.ess:.0f}, {wall:.1f} s; "
          f"errors {out['check']['mean_err']:.3f} / {out['check']['sd_err']:.3f}", flush=True)
    start_err = errors(*chk.start_moments, ref_mean, ref_sd)
    out["check"]["start_moments_match_q"] = bool(np.allclose(start_err, (
        out["PVI q"]["mean_err"], out["PVI q"]["sd_err"])))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        t0 = time.perf_counter()
        ref = res.refine(key, clients, num_rounds=args.refine_rounds, num_draws=args.num_draws,
                         method="importance",
                         progress_bar=False, khat_target=args.khat_target,
                         ess_target=args.ess_target, **settings)
        wall = time.perf_counter() - t0
    out["refine"] = importance_row(ref, wall, ref_mean, ref_sd, ref_ess, caught)
    rows = replay(ref, ref_mean, ref_sd, ref_ess)
    out["refine_rounds"] = rows
    out["replay_matches_check"] = bool(np.isclose(rows[0]["khat"], chk.khat)
                                       and np.isclose(rows[0]["ess"], chk.ess))
    out["replay_matches_refine"] = bool(np.isclose(rows[-1]["khat"], ref.khat)
                                        and np.isclose(rows[-1]["ess"], ref.ess))
    for r in rows:
        print(f"  refine round {r['round']}: k-hat {r['khat']:.2f}, ESS {r['ess']:.0f}, "
              f"errors {r['mean_err']:.3f} / {r['sd_err']:.3f}, {r['seconds']:.1f} s",
              flush=True)
    return out


def hierarchical(args) -> dict:
    seed = args.seed
    pooled, _, clients = hier.simulate(seed)
    guide = fedppl.PVIGuide(hier.model, hier.GLOBAL, family="fullrank").setup(
        *clients.client(0), n_groups=hier.n_groups())
    assert [s.name for s in guide.layout_or_raise().sites] == list(hier.GLOBAL)
    run: dict = {"seed": seed}
    if args.reference_from:
        with open(args.reference_from) as f:
            saved = json.load(f)
        s = saved["settings"]
        match = [r for r in saved["seeds"] if r["seed"] == seed]
        if not match or s.get("inputs", hier.D) != hier.D or s.get("clients", hier.K) != hier.K:
            raise SystemExit(f"{args.reference_from} has no reference for seed {seed}, "
                             f"D = {hier.D}, K = {hier.K}")
        ref_mean = np.asarray(match[0]["reference"]["mean"])
        ref_sd = np.asarray(match[0]["reference"]["sd"])
        ref_ess = np.full_like(ref_mean, np.inf)
        run["reference"] = {"from": args.reference_from, "ref_warmup": s.get("ref_warmup"),
                            "ref_samples": s.get("ref_samples"),
                            "seconds": match[0].get("pooled_nuts_seconds")}
    else:
        t0 = time.perf_counter()
        draws = hier.pooled_nuts(pooled, guide, seed, args.ref_samples, args.ref_warmup)
        ref_mean, ref_sd, ref_ess = draws.mean(0), draws.std(0, ddof=1), nuts_ess(draws)
        run["reference"] = {"from": "pooled NUTS", "ref_warmup": args.ref_warmup,
                            "ref_samples": args.ref_samples,
                            "seconds": time.perf_counter() - t0,
                            "min_ess": float(ref_ess.min())}
    run["reference"].update(mean=ref_mean.tolist(), sd=ref_sd.tolist())
    print(f"reference ({run['reference']['from']}): {run['reference']['seconds']:.0f} s",
          flush=True)
    pvi = fedppl.PVI(hier.model, fedppl.PVIGuide(hier.model, hier.GLOBAL, family="fullrank"),
                     elbo_samples=0)
    t0 = time.perf_counter()
    res = pvi.run(jax.random.key(seed), clients, num_rounds=args.pvi_rounds,
                  progress_bar=False, n_groups=hier.n_groups())
    run["pvi_seconds"] = time.perf_counter() - t0
    print(f"PVI: {args.pvi_rounds} rounds, {run['pvi_seconds']:.0f} s", flush=True)
    run["methods"] = check_and_refine(res, clients, jax.random.key(100 + seed), args, ref_mean,
                                      ref_sd, ref_ess)
    return run


def breast_cancer(args) -> dict:
    seed = args.seed
    X, y, _, clients = bc.load(args.clients, seed)
    guide = fedppl.PVIGuide(bc.model, family="fullrank").setup(*clients.client(0))
    t0 = time.perf_counter()
    draws = bc.pooled_nuts(X, y, guide, seed, args.ref_samples)
    ref_mean, ref_sd, ref_ess = draws.mean(0), draws.std(0, ddof=1), nuts_ess(draws)
    run: dict = {"seed": seed, "reference": {
        "from": "pooled NUTS", "ref_warmup": 1000, "ref_samples": args.ref_samples,
        "seconds": time.perf_counter() - t0, "min_ess": float(ref_ess.min()),
        "mean": ref_mean.tolist(), "sd": ref_sd.tolist()}}
    print(f"reference (pooled NUTS): {run['reference']['seconds']:.0f} s, min ESS "
          f"{ref_ess.min():.0f}", flush=True)
    pvi = fedppl.PVI(bc.model, fedppl.PVIGuide(bc.model, family="fullrank"), "synchronous",
                     0.5, elbo_samples=0)
    t0 = time.perf_counter()
    res = pvi.run(jax.random.key(seed), clients, num_rounds=args.pvi_rounds, progress_bar=False)
    run["pvi_seconds"] = time.perf_counter() - t0
    print(f"PVI: {args.pvi_rounds} rounds, {run['pvi_seconds']:.0f} s", flush=True)
    run["methods"] = check_and_refine(res, clients, jax.random.key(100 + seed), args, ref_mean,
                                      ref_sd, ref_ess)
    return run


def table(run: dict, args) -> None:
    what = (f"hierarchical: J = {hier.J}, D = {hier.D}, K = {hier.K}, 42 global coordinates"
            if args.task == "hierarchical" else
            f"breast cancer: K = {args.clients}, 31 coordinates")
    print(f"\n{what}; seed {run['seed']}; S = {args.num_draws} draws per round; reference "
          f"{run['reference']['from']}")
    print("| answer | rounds | draws | worst mean err (sd) | worst sd err | k-hat | ESS | "
          "worst z (MC) | within MC | local sd | s/round | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    m = run["methods"]
    q = m["PVI q"]
    print(f"| PVI q | {q['rounds']} | - | {q['mean_err']:.3f} | {q['sd_err']:.3f} | "
          f"{m['check']['khat']:.2f} (check) | {m['check']['ess']:.0f} (check) | - | - | - | "
          f"{q['seconds_per_round']:.2f} | {run['pvi_seconds']:.0f} |")
    for name in ("check", "refine"):
        r = m[name]
        print(f"| {name} | {r['rounds']} | {r['draws']} | {r['mean_err']:.3f} | "
              f"{r['sd_err']:.3f} | {r['khat']:.2f} | {r['ess']:.0f} | {r['worst_z']:.1f} | "
              f"{'- (k-hat)' if r['within_mc'] is None else r['within_mc']} | "
              f"{r.get('local_sd', float('nan')):.2f} | {r['seconds_per_round']:.2f} | "
              f"{r['wall_seconds']:.0f} |")
    print("\nrefine, per round (moments of all draws so far):")
    print("| round | draws | k-hat | ESS | worst mean err | worst sd err | 1/sqrt(ESS) | "
          "worst mcse (sd) | worst z | local sd | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in m["refine_rounds"]:
        print(f"| {r['round']} | {r['draws']} | {r['khat']:.2f} | {r['ess']:.0f} | "
              f"{r['mean_err']:.3f} | {r['sd_err']:.3f} | {r['mean_mc']:.3f} | "
              f"{r['worst_mcse']:.3f} | {r['worst_z']:.1f} | "
              f"{r.get('local_sd', float('nan')):.2f} | {r['seconds']:.1f} |")


def sources() -> dict:
    """Which fedppl this measured (its sources are being edited): the commit and a hash of
    every module as imported."""
    import hashlib
    import subprocess

    root = Path(fedppl.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.read_bytes())
    imp_files = {str(f.relative_to(root.parent)): hashlib.sha256(f.read_bytes()).hexdigest()[:12]
                 for f in (root / "algorithms" / "importance.py",
                           root / "infer" / "importance.py") if f.exists()}
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=root.parent).stdout.strip()
    return {"commit": head, "all_modules_sha256": digest.hexdigest()[:12]} | imp_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("hierarchical", "breast-cancer"), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=10, help="breast cancer's K")
    ap.add_argument("--pvi-rounds", type=int, default=20)
    ap.add_argument("--num-draws", type=int, default=2000, help="S, draws per round")
    ap.add_argument("--refine-rounds", type=int, default=10)
    ap.add_argument("--khat-target", type=float, default=0.5, help="refine stops below it "
                    "(and at --ess-target; fedppl's defaults)")
    ap.add_argument("--ess-target", type=float, default=2000.0,
                    help="a large value makes refine run all --refine-rounds")
    ap.add_argument("--local-draws", type=int, default=None,
                    help="hierarchical: each client's Laplace importance draws per global draw "
                         "(default: fedppl's)")
    ap.add_argument("--ref-warmup", type=int, default=500, help="hierarchical's pooled NUTS")
    ap.add_argument("--ref-samples", type=int, default=None,
                    help="pooled NUTS draws per chain (default 1500 hierarchical, 5000 breast "
                         "cancer, as ep_hierarchical.json and ep_vs_pvi.py)")
    ap.add_argument("--reference-from", default="",
                    help="hierarchical: read the reference from ep_hierarchical.py's JSON")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.ref_samples is None:
        args.ref_samples = 1500 if args.task == "hierarchical" else 5000
    if args.quick:
        args.pvi_rounds, args.num_draws, args.refine_rounds = 3, 200, 3
        args.ref_warmup, args.ref_samples = 200, 200 if args.task == "hierarchical" else 1000
    if not args.out:
        suffix = "" if args.task == "hierarchical" else f"_k{args.clients}"
        args.out = (f"benchmarks/results/check_refine_{args.task.replace('-', '_')}{suffix}"
                    f"{'_quick' if args.quick else ''}.json")
    warnings.simplefilter("ignore", RuntimeWarning)
    results: dict = {
        "settings": vars(args),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "cpus_used": len(os.sched_getaffinity(0)), "jax": jax.__version__,
                    "numpyro": numpyro.__version__, "device": str(jax.devices()[0]),
                    "float64": bool(jax.config.jax_enable_x64)},
        "fedppl_sources": sources()}
    t0 = time.perf_counter()
    run = hierarchical(args) if args.task == "hierarchical" else breast_cancer(args)
    results["run"] = run
    results["wall_seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(stamp(results), f, indent=1)
    table(run, args)
    print(f"wrote {args.out} ({results['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
