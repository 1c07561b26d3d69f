"""The renderers of the benchmark pages: one table renderer (:data:`RENDERERS`) or plotter
(:data:`PLOTS`) per result schema, computed from the JSON's data; :func:`render` and
:func:`plot_series` are what the directives call. No Sphinx, no matplotlib (see
:mod:`benchdata`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from benchdata import (
    Plot,
    Series,
    Table,
    _decode,
    _items,
    _where,
    fmt,
    get,
    load,
    render_markdown,
    render_rows,
)


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

def _pair(d: Any) -> str:
    d = _decode(d)
    if not d:
        return "-"
    return f"{d['mean_error']:.3f} / {d['sd_ratio']:.3f}"


def render_model_gallery(datas, options):
    """Per model: rounds, seconds, and (worst mean error in sd / worst sd ratio) against pooled
    SVI and NUTS, with the local sites' (worst client) in brackets."""
    header = ["model", "rounds", "s", "vs pooled SVI", "vs NUTS", "pooled SVI vs NUTS"]
    rows = []
    for _name, data in datas:
        for r in data["rows"]:
            if r.get("error"):
                rows.append([r["model"], "-", "-", f"error: {r['error']}", "-", "-"])
                continue
            svi, nuts = _pair(r.get("vs_svi")), _pair(r.get("vs_nuts"))
            if r.get("local_vs_svi"):
                svi += f" (local {_pair(r['local_vs_svi'])})"
            if r.get("local_vs_nuts"):
                nuts += f" (local {_pair(r['local_vs_nuts'])})"
            rows.append(
                [
                    r["model"],
                    fmt(r.get("rounds")),
                    fmt(r.get("seconds"), ".1f"),
                    svi,
                    nuts,
                    _pair(r.get("svi_vs_nuts")),
                ]
            )
    return [Table(options.get("caption"), header, rows)]


def render_gallery_refine(datas, options):
    """The check and refine on each gallery model (errors against NUTS: mean in sd / sd ratio)."""
    header = [
        "model",
        "PVI vs NUTS",
        "check k-hat",
        "refine rounds",
        "refined k-hat",
        "refined ESS",
        "refined vs NUTS",
    ]
    rows = []
    for _name, data in datas:
        for r in data["rows"]:
            if "khat_check" not in r:
                rows.append(
                    [
                        r["model"],
                        _pair(r.get("vs_nuts")),
                        "-",
                        "-",
                        "-",
                        "-",
                        str(r.get("refine_error") or r.get("error") or "-")[:80],
                    ]
                )
                continue
            rows.append(
                [
                    r["model"],
                    _pair(r.get("vs_nuts")),
                    fmt(r["khat_check"], ".2f"),
                    fmt(r.get("refine_rounds")),
                    fmt(r.get("khat_refined"), ".2f"),
                    fmt(r.get("ess_refined"), ".0f"),
                    _pair(r.get("refined_vs_nuts")),
                ]
            )
    return [Table(options.get("caption"), header, rows)]


def _total(value: Any) -> int:
    if isinstance(value, list):
        return sum(_total(v) for v in value)
    return int(value or 0)


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _span(values: list[float], spec: str) -> str:
    lo, hi = format(min(values), spec), format(max(values), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def render_pvi_accuracy(datas, options):
    """Worst errors after the last round, ranges over the partition seeds: mean error in sd
    against GlobalVI with the same draws ("same") and a converged GlobalVI ("conv")."""
    header = [
        "task",
        "family",
        "K",
        "local step",
        "damping",
        "rounds",
        "seeds",
        "mean error (same / conv)",
        "sd error (same / conv)",
        "s/round",
        "rejected",
    ]
    groups: dict[tuple, list[dict]] = {}
    for _name, data in datas:
        for r in data["runs"]:
            key = (r["task"], r["family"], r["K"], r["solver"], r["damping"], r["rounds"])
            groups.setdefault(key, []).append(r)
    rows = []
    for key, runs in groups.items():
        def last(name, runs=runs):
            return [r[name][-1] for r in runs]

        rows.append(
            [
                *map(str, key[:2]),
                str(key[2]),
                key[3],
                fmt(key[4]),
                str(key[5]),
                str(len(runs)),
                f"{_span(last('mean_same'), '.3f')} / {_span(last('mean_conv'), '.3f')}",
                f"{_span(last('sd_same'), '.3f')} / {_span(last('sd_conv'), '.3f')}",
                _span(
                    [
                        _median(r["seconds"][1:] or r["seconds"])
                        if isinstance(r["seconds"], list)
                        else r["seconds"] / r["rounds"]
                        for r in runs
                    ],
                    ".3f",
                ),
                str(sum(_total(r.get("rejected")) for r in runs)),
            ]
        )
    return [Table(options.get("caption"), header, rows)]


def render_pvi_accuracy_glm(datas, options):
    """The simulated Poisson and probit regressions: worst errors after the last round."""
    header = [
        "task",
        "family",
        "damping",
        "rounds",
        "mean error (same / conv)",
        "sd error (same / conv)",
    ]
    rows = []
    for _name, data in datas:
        for task in data.get("glm") or []:
            for r in task["runs"]:
                rows.append(
                    [
                        task["task"],
                        r["family"],
                        fmt(r["damping"]),
                        str(r["rounds"]),
                        f"{r['mean_same'][-1]:.3f} / {r['mean_conv'][-1]:.3f}",
                        f"{r['sd_same'][-1]:.3f} / {r['sd_conv'][-1]:.3f}",
                    ]
                )
        long = data.get("long")
        if long:
            rows.append(
                [
                    f"breast cancer, long run (K = {long['K']})",
                    "fullrank",
                    fmt(long["damping"]),
                    str(long["rounds"]),
                    f"{long['mean_same'][-1]:.3f} / {long['mean_conv'][-1]:.3f}",
                    f"{long['sd_same'][-1]:.3f} / {long['sd_conv'][-1]:.3f}",
                ]
            )
    return [Table(options.get("caption"), header, rows)]


def _diff_leaves(obj: Any, path: str = "", parent: str = "") -> list[tuple[float, str]]:
    obj = _decode(obj)
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _diff_leaves(v, f"{path}/{k}" if path else str(k), str(k))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        key = path.rsplit("/", 1)[-1]
        if ("abs" in key or parent == "history" or "/history/" in f"/{path}") and "rel" not in key:
            out.append((float(obj), path))
    return out


def render_same_numbers(datas, options):
    """The largest absolute difference, before against after, of every case (and where)."""
    header = ["result file", "case", "largest absolute difference", "where"]
    rows = []
    for name, data in datas:
        cases = get(data, options.get("rows") or next(k for k in ("cases", "summary") if k in data))
        for case, value in cases.items():
            leaves = _diff_leaves(value)
            if not leaves:
                continue
            worst = max(leaves)
            where = (
                value.get("worst") if isinstance(value, dict) and value.get("worst") else worst[1]
            )
            rows.append(
                [name, case, fmt(worst[0], ".1e") if worst[0] else "0 (bit-identical)", str(where)]
            )
    return [Table(options.get("caption"), header, rows)]


RENDERERS: dict[str, Callable[[list[tuple[str, Any]], dict], list[Table]]] = {
    "rows": render_rows,
    "markdown": render_markdown,
    "ep_vs_pvi": render_ep_vs_pvi,
    "ep_hierarchical": render_ep_hierarchical,
    "ep_sd_ratio": render_ep_sd_ratio,
    "ep_rounds": render_ep_rounds,
    "check_refine": render_check_refine,
    "check_refine_rounds": render_check_refine_rounds,
    "smc": render_smc,
    "smc_breadth": render_smc_breadth,
    "model_gallery": render_model_gallery,
    "gallery_refine": render_gallery_refine,
    "pvi_accuracy": render_pvi_accuracy,
    "pvi_accuracy_glm": render_pvi_accuracy_glm,
    "same_numbers": render_same_numbers,
}


def render(files: list[str], options: dict) -> list[Table]:
    """The tables of a ``bench-table`` directive."""
    datas = [(f, load(f)) for f in files]
    tables = RENDERERS[options.get("renderer", "rows")](datas, options)
    if options.get("caption") and len(tables) == 1 and not tables[0].title:
        tables[0].title = options["caption"]
    return tables



# --- plots ---------------------------------------------------------------------------------


def plot_pvi_rounds(datas, options):
    ((_n, d),) = datas
    res = d["results"]
    ks = [r["K"] for r in res]
    return Plot(
        "clients K",
        "seconds per synchronous round",
        [
            Series("vmap (one compiled round)", ks, [r["vmap"]["round_s"] for r in res]),
            Series("loop (Python loop over clients)", ks, [r["loop"]["round_s"] for r in res]),
        ],
        logx=True,
        logy=True,
    )


def plot_dp_pvi(datas, options):
    ((_n, d),) = datas
    metric = options.get("metric", "test_log_lik")
    series: dict[str, Series] = {}
    finite = [
        r["epsilon"]
        for r in d["rows"]
        if r["epsilon"] not in (None, "inf") and math.isfinite(float(r["epsilon"]))
    ]
    top = max(finite) * 2 if finite else 16.0
    for r in d["rows"]:
        eps = float(r["epsilon"]) if r["epsilon"] not in (None, "inf") else math.inf
        s = series.setdefault(r["variant"], Series(r["variant"], [], []))
        s.x.append(eps if math.isfinite(eps) else top)
        s.y.append(r[metric])
    return Plot(
        f"epsilon (the last point: no noise, at {top:g})",
        metric.replace("_", " "),
        list(series.values()),
        logx=True,
    )


def plot_ep_vs_pvi(datas, options):
    ((_n, d),) = datas
    seed = d["seeds"][int(options.get("seed", 0))]
    key = options.get("metric", "mean_err")
    return Plot(
        "round",
        f"worst {'mean' if key == 'mean_err' else 'sd'} error against pooled NUTS",
        [
            Series(m, [r["round"] for r in v["rows"]], [r[key] for r in v["rows"]])
            for m, v in seed["methods"].items()
        ],
        logy=True,
        hline=0.05,
    )


def plot_by_method(datas, options):
    """Generic: ``:x:`` against ``:y:`` of ``:rows:``, one line per ``:group:`` value."""
    ((_n, d),) = datas
    groups: dict[str, Series] = {}
    for r in _where(_items(get(d, options.get("rows", "rows"))), options.get("where")):
        if get(r, options["y"]) is None:
            continue
        g = str(get(r, options.get("group", "method")))
        s = groups.setdefault(g, Series(g, [], []))
        s.x.append(float(get(r, options["x"])))
        s.y.append(float(get(r, options["y"])))
    return Plot(
        options.get("xlabel", options["x"]),
        options.get("ylabel", options["y"]),
        list(groups.values()),
        logx="x" in options.get("log", ""),
        logy="y" in options.get("log", ""),
    )


def plot_polya_gamma(datas, options):
    ((_n, d),) = datas
    series = []
    for r in d["results"]:
        y = _decode(r["max_abs_to_reference_per_round"])
        series.append(
            Series(
                f"{r['method']}, {r['schedule']} ({fmt(r['damping'])})",
                list(range(1, len(y) + 1)),
                y,
            )
        )
    return Plot(
        "round",
        "max abs distance of the posterior mean from its reference",
        series,
        logx=True,
        logy=True,
        hline=1e-3,
    )


PLOTS: dict[str, Callable[[list[tuple[str, Any]], dict], Plot]] = {
    "pvi_rounds": plot_pvi_rounds,
    "dp_pvi": plot_dp_pvi,
    "ep_vs_pvi": plot_ep_vs_pvi,
    "by_method": plot_by_method,
    "polya_gamma": plot_polya_gamma,
}


def plot_series(files: list[str], options: dict) -> Plot:
    """The data of a ``bench-plot`` directive (no drawing)."""
    return PLOTS[options["plotter"]]([(f, load(f)) for f in files], options)
