"""The renderers of results measured against pooled NUTS: EP (against PVI and one-shot merges,
on a hierarchical scale, round by round), the importance check and refine, and the federated SMC
sampler. :mod:`benchrenderers` registers them with the rest; no Sphinx, no matplotlib.
"""

from __future__ import annotations

from benchdata import Table, _median, fmt, render_rows


def _final(rows: list[dict]) -> dict:
    return rows[-1] if rows else {}


def render_ep_vs_pvi(datas, options):
    """EP / PVI / one-shot against pooled NUTS after the last round, one column group per seed."""
    ((_name, data),) = datas
    seeds = data["seeds"]
    ids = " / ".join(str(s["seed"]) for s in seeds)
    header = [
        "method",
        "rounds",
        f"worst mean error (sd), seeds {ids}",
        "worst sd error",
        "test log-lik",
        "first round within target",
        "rounds to converge",
        "s/round (median)",
    ]
    rows = []
    for method in seeds[0]["methods"]:
        per = [s["methods"].get(method) for s in seeds]
        if any(p is None for p in per):
            continue
        lasts = [_final(p["rows"]) for p in per]
        secs = sorted(r["seconds"] for p in per for r in p["rows"][1:]) or [float("nan")]
        rows.append(
            [
                method,
                str(lasts[0].get("round")),
                " / ".join(fmt(r.get("mean_err"), ".3f") for r in lasts),
                " / ".join(fmt(r.get("sd_err"), ".3f") for r in lasts),
                " / ".join(fmt(r.get("test_ll"), ".4f") for r in lasts),
                " / ".join(fmt(p.get("within_target")) for p in per),
                " / ".join(fmt(p.get("converged")) for p in per),
                fmt(secs[len(secs) // 2], ".3g"),
            ]
        )
    for method in seeds[0].get("one_shot") or {}:
        per = [s["one_shot"][method] for s in seeds]
        rows.append(
            [
                f"{method} one-shot",
                "1",
                " / ".join(fmt(p.get("mean_err"), ".3f") for p in per),
                " / ".join(fmt(p.get("sd_err"), ".3f") for p in per),
                " / ".join(fmt(p.get("test_ll"), ".4f") for p in per),
                "-",
                "1",
                fmt(per[0].get("seconds"), ".3g"),
            ]
        )
    rows.append(
        [
            "pooled NUTS (reference)",
            "-",
            "0",
            "0",
            " / ".join(fmt(s.get("pooled_nuts_test_ll"), ".4f") for s in seeds),
            "-",
            "-",
            "-",
        ]
    )
    return [Table(options.get("caption"), header, rows)]


def _method_rows(seed):
    """``(method, rows)`` of one seed's run: a method's rows are a list, or under ``"rows"``."""
    for method, runs in seed["methods"].items():
        yield method, runs if isinstance(runs, list) else runs.get("rows", [])


def render_ep_hierarchical(datas, options):
    """Each method's last round against pooled NUTS (one row per method and file)."""
    header = [
        "result file",
        "method",
        "round",
        "worst mean error (sd)",
        "worst sd error",
        "s/round (median)",
    ]
    rows = []
    for name, data in datas:
        for seed in data["seeds"]:
            for method, runs in _method_rows(seed):
                if not runs:
                    continue
                last = runs[-1]
                secs = [r["seconds"] for r in runs if r.get("seconds") is not None]
                rows.append(
                    [
                        name,
                        method,
                        str(last["round"]),
                        fmt(last["mean_err"], ".2f"),
                        fmt(last["sd_err"], ".2f"),
                        fmt(_median(secs), ".3g") if secs else "-",
                    ]
                )
            for method, m in (seed.get("merges") or {}).items():
                refused = method == "refused"  # OneShot refused to merge unmixed chains
                rows.append(
                    [
                        name,
                        "one-shot merges" if refused else f"{method} one-shot",
                        "-",
                        "refused" if refused else fmt(m.get("mean_err"), ".2f"),
                        "refused" if refused else fmt(m.get("sd_err"), ".2f"),
                        fmt(m.get("seconds"), ".3g"),
                    ]
                )
    return [Table(options.get("caption"), header, rows)]


def render_ep_rounds(datas, options):
    """EP round by round: errors against pooled NUTS, the clients whose updates were applied
    (their chains mixed), the clients whose chains were extended, seconds."""
    header = ["result file", "method", "round", "worst mean error (sd)", "worst sd error",
              "updates applied", "clients extended", "seconds"]
    rows = []
    for name, data in datas:
        for seed in data["seeds"]:
            for method, runs in _method_rows(seed):
                for r in runs:
                    if "clients_active" not in r:
                        continue
                    rows.append([name, method, str(r["round"]), fmt(r["mean_err"], ".2f"),
                                 fmt(r["sd_err"], ".2f"),
                                 f"{r['clients_mixed']} / {r['clients_active']}",
                                 fmt(r.get("clients_extended")), fmt(r["seconds"], ".3g")])
    return [Table(options.get("caption"), header, rows)]


def render_ep_sd_ratio(datas, options):
    """EP's last sd over pooled NUTS's sd, per file (a number of clients), for the weakest
    log-scale (the log sigma with the largest pooled sd) and the range over the others."""
    header = [
        "result file",
        "clients K",
        "estimator",
        "rounds",
        "EP sd / pooled sd, weakest log-scale",
        "the other coordinates",
    ]
    rows = []
    for name, data in datas:
        seed = data["seeds"][0]
        ref_sd = seed["reference"]["sd"]
        ep_sd = seed["ep_last"]["sd"]
        d = len(ref_sd) // 2  # (mu, log sigma)
        weakest = max(range(d, 2 * d), key=lambda i: ref_sd[i])
        ratios = [e / r for e, r in zip(ep_sd, ref_sd, strict=True)]
        others = [x for i, x in enumerate(ratios) if i != weakest]
        rows.append(
            [
                name,
                str(data["settings"]["clients"]),
                str(data["settings"]["estimator"]),
                str(len(seed["methods"]["EP"])),
                fmt(ratios[weakest], ".2f"),
                f"{min(others):.2f}-{max(others):.2f}",
            ]
        )
    return [Table(options.get("caption"), header, rows)]


def render_check_refine(datas, options):
    """PVI's q, the check's corrected moments and refine's, against pooled NUTS."""
    header = [
        "result file",
        "estimate",
        "rounds",
        "worst mean error (sd)",
        "worst sd error",
        "k-hat",
        "ESS",
        "reliable",
    ]
    rows = []
    for name, data in datas:
        m = data["run"]["methods"]
        rr = m.get("refine_rounds") or []
        rows.append(
            [
                name,
                "PVI q",
                fmt(m["PVI q"]["rounds"]),
                fmt(m["PVI q"]["mean_err"], ".3f"),
                fmt(m["PVI q"]["sd_err"], ".3f"),
                "-",
                "-",
                "-",
            ]
        )
        for label, key, r in (
            ("check (corrected moments)", "check", rr[0] if rr else {}),
            ("refine", "refine", rr[-1] if rr else {}),
        ):
            s = m[key]
            rows.append(
                [
                    name,
                    label,
                    fmt(s["rounds"]),
                    fmt(r.get("mean_err"), ".3f"),
                    fmt(r.get("sd_err"), ".3f"),
                    fmt(s["khat"], ".2f"),
                    fmt(s["ess"], ".0f"),
                    fmt(s["reliable"]),
                ]
            )
    return [Table(options.get("caption"), header, rows)]


def render_check_refine_rounds(datas, options):
    """Refine round by round: its diagnostics and its distance from pooled NUTS."""
    ((_name, data),) = datas
    return render_rows(
        [(_name, data)],
        {
            "rows": "run.methods.refine_rounds",
            "columns": "round, draws, khat=k-hat|.2f, ess=ESS|.0f, "
            "mean_err=worst mean error (sd)|.3f, "
            "sd_err=worst sd error|.3f, worst_mcse=its Monte Carlo error (sd)|.3f, "
            "worst_z=worst error / Monte Carlo error|.1f, local_sd=local sd (nats)|.2f",
            "caption": options.get("caption"),
        },
    )


def render_smc(datas, options):
    """The SMC sampler against pooled NUTS: one row per file, seed and start (the answer the
    sampler's own stopping rule gave, and the last round's when it ran past it)."""
    header = ["result file", "seed", "start", "start errors (mean sd / sd)", "rounds",
              "reached, renewed", "worst mean error (sd)", "its Monte Carlo error (sd)",
              "worst sd error", "local sd (nats)", "last round's errors", "s / round"]
    rows = []
    for name, data in datas:
        for run in data["seeds"]:
            for start, out in run["starts"].items():
                f, s, last = out["final"], out["start"], out["rounds"][-1]
                rows.append([
                    name, fmt(run["seed"]), start,
                    f"{fmt(s['mean_err'], '.2f')} / {fmt(s['sd_err'], '.2f')}",
                    fmt(f["rounds"]) + ("" if f["stopped_by_rule"] else " (no stop)"),
                    f"{fmt(f['reached'])}, {fmt(f['renewed'], '.2f')}",
                    fmt(f["mean_err"], ".3f"), fmt(f["stated_mean_mcse"], ".3f"),
                    fmt(f["sd_err"], ".3f"), fmt(f.get("local_sd"), ".2f"),
                    f"round {last['round']}: {fmt(last['mean_err'], '.3f')} / "
                    f"{fmt(last['sd_err'], '.3f')}",
                    fmt(f["seconds_per_round"], ".1f")])
    return [Table(options.get("caption"), header, rows)]


def render_smc_breadth(datas, options):
    """The SMC sampler beside PVI on each task of ``smc_breadth.py``, against pooled NUTS."""
    header = ["task", "PVI (mean sd / sd)", "sampler (mean sd / sd)",
              "its Monte Carlo error (sd)", "worst error / Monte Carlo error",
              "reference's MC error (sd)", "rounds", "reached, renewed", "local sd (nats)",
              "s / round",
              "importance refinement (mean sd / sd)"]
    rows = []
    for _name, data in datas:
        for r in data["rows"]:
            p, s = r["pvi"], r["smc"]
            imp = s.get("importance")
            rows.append([
                r["task"], f"{fmt(p['mean_err'], '.3f')} / {fmt(p['sd_err'], '.3f')}",
                f"{fmt(s['mean_err'], '.3f')} / {fmt(s['sd_err'], '.3f')}",
                fmt(s["stated_mean_mcse"], ".3f"), fmt(s["worst_z"], ".1f"),
                fmt(s["reference_mc"], ".3f"), fmt(s["rounds"]),
                f"{fmt(s['reached'])}, {fmt(s['renewed'], '.2f')}",
                fmt(s.get("local_sd"), ".2f"), fmt(s["seconds_per_round"], ".1f"),
                f"{fmt(imp['mean_err'], '.3f')} / {fmt(imp['sd_err'], '.3f')}" if imp
                else "- (not chosen)"])
    return [Table(options.get("caption"), header, rows)]
