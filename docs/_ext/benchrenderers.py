"""The renderers of the benchmark pages: one table renderer (:data:`RENDERERS`) or plotter
(:data:`PLOTS`) per result schema, computed from the JSON's data; :func:`render` and
:func:`plot_series` are what the directives call. The renderers of results against pooled NUTS
(EP, check and refine, SMC) live in :mod:`benchpooled`. No Sphinx, no matplotlib (see
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
    _median,
    _where,
    fmt,
    get,
    load,
    render_markdown,
    render_rows,
)
from benchpooled import (
    render_check_refine,
    render_check_refine_rounds,
    render_ep_hierarchical,
    render_ep_rounds,
    render_ep_sd_ratio,
    render_ep_vs_pvi,
    render_smc,
    render_smc_breadth,
)


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


def render_gallery_smc(datas, options):
    """The SMC sampler from PVI on each gallery model it ran on (errors against NUTS: mean in
    sd / sd ratio), with its own diagnostics beside them."""
    header = ["model", "PVI vs NUTS", "sampler vs NUTS", "its Monte Carlo error (sd)",
              "reached, renewed", "local sd (nats)", "rounds", "s"]
    rows = []
    for _name, data in datas:
        for r in data["rows"]:
            if "smc_rounds" not in r:
                rows.append([r["model"], _pair(r.get("vs_nuts")),
                             str(r.get("smc_error") or r.get("error") or "-")[:80],
                             "-", "-", "-", "-", "-"])
                continue
            rows.append([r["model"], _pair(r.get("vs_nuts")), _pair(r.get("smc_vs_nuts")),
                         fmt(r["smc_stated_mcse"], ".3f"),
                         f"{fmt(r['smc_reached'])}, {fmt(r['smc_renewed'], '.2f')}",
                         fmt(r["smc_local_sd"], ".2f"), fmt(r["smc_rounds"]),
                         fmt(r["smc_seconds"], ".1f")])
    return [Table(options.get("caption"), header, rows)]


def _total(value: Any) -> int:
    if isinstance(value, list):
        return sum(_total(v) for v in value)
    return int(value or 0)


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
    "gallery_smc": render_gallery_smc,
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
