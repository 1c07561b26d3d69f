"""Benchmark pages: tables and plots generated from ``benchmarks/results/*.json``.

Three MyST directives, so that a benchmark page cannot disagree with its result files (the
files are read when the page is built, and registered as the page's dependencies: a changed
result rebuilds the page):

``bench-info``
    The result file(s), the machine and the wall time recorded in them, and the command that
    reproduces them: the directive's content, or (``:script: STEM``) the ``python
    benchmarks/...`` lines of the benchmark script's docstring::

        ```{bench-info} pvi_rounds.json
        :script: pvi_rounds
        ```

``bench-table``
    One or more tables from one or more result files (names relative to
    ``benchmarks/results/``). ``:renderer:`` picks the renderer (:data:`RENDERERS`); the
    generic ``rows`` renderer takes ``:rows:`` (a dotted path to a list or dict in the JSON),
    ``:columns:`` (comma-separated ``path=Label|format``; ``a±b`` for "a ± b"), ``:where:``
    (``path=value`` filters, comma-separated) and ``:digits:`` (significant digits)::

        ```{bench-table} pvi_rounds.json
        :rows: results
        :columns: K, vmap=vmap s/round, loop=loop s/round, ratio_loop_over_vmap=loop / vmap|.1f
        ```

``bench-plot``
    A matplotlib figure (:data:`PLOTS`) drawn at build time into
    ``docs/benchmarks/_generated/`` (git-ignored).

The data side (:func:`load`, :func:`render`, :func:`plot_series`, :func:`find_directives`)
imports neither Sphinx nor matplotlib, so ``tests/test_docs_benchpages.py`` checks every page's
tables in well under a second.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPTS = ROOT / "benchmarks"
GENERATED = ROOT / "docs" / "benchmarks" / "_generated"


# --- reading ------------------------------------------------------------------------------


def result_path(name: str) -> Path:
    """The path of a result file named relative to ``benchmarks/results/``."""
    return RESULTS / name


def load(name: str) -> Any:
    """The parsed JSON of ``benchmarks/results/<name>``."""
    return json.loads(result_path(name).read_text())


def _decode(value: Any) -> Any:
    # some result files store nested records as JSON strings
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def get(obj: Any, path: str, default: Any = None) -> Any:
    """``obj`` at a dotted ``path`` (list indexes as integers; JSON strings are decoded)."""
    if path in ("", "."):
        return obj
    cur = _decode(obj)
    for part in path.split("."):
        if isinstance(cur, dict):
            if part not in cur:
                return default
            cur = cur[part]
        elif isinstance(cur, list):
            try:
                cur = cur[int(part)]
            except (ValueError, IndexError):
                return default
        else:
            return default
        cur = _decode(cur)
    return cur


def fmt(value: Any, spec: str | None = None, digits: int = 4) -> str:
    """A cell's text: ``spec`` is a Python format spec; floats get ``digits`` significant."""
    value = _decode(value)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v, spec, digits) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if isinstance(value, float) and math.isnan(value):
            return "nan"
        if spec:
            return format(value, spec)
        if isinstance(value, int):
            return f"{value:,}" if abs(value) >= 10000 else str(value)
        if value == 0:
            return "0"
        if abs(value) >= 10**digits:
            return f"{value:,.0f}"
        if abs(value) < 1e-3:
            return f"{value:.{max(digits - 2, 1)}e}"
        return f"{value:.{digits}g}"
    return str(value)


def _cell(row: Any, path: str, spec: str | None, digits: int) -> str:
    if "±" in path:
        a, b = path.split("±", 1)
        return (
            f"{fmt(get(row, a.strip()), spec, digits)} ± {fmt(get(row, b.strip()), spec, digits)}"
        )
    if path == "_key":
        return str(row.get("_key", ""))
    return fmt(get(row, path), spec, digits)


# --- tables -------------------------------------------------------------------------------


@dataclass
class Table:
    """A rendered table: a caption (or None), a header and rows of cell texts."""

    title: str | None
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)


def _split(option: str | None) -> list[str]:
    return [p.strip() for p in (option or "").split(",") if p.strip()]


def _items(obj: Any) -> list[Any]:
    """A list as is; a dict as its values, each with its key under ``_key``."""
    obj = _decode(obj)
    if isinstance(obj, list):
        return [_decode(o) for o in obj]
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            v = _decode(v)
            out.append({"_key": k, **v} if isinstance(v, dict) else {"_key": k, "value": v})
        return out
    raise ValueError(f"not a list or dict: {type(obj).__name__}")


def _where(rows: list[Any], option: str | None) -> list[Any]:
    for cond in _split(option):
        path, _, want = cond.partition("=")
        rows = [
            r
            for r in rows
            if fmt(get(r, path.strip()), None, 12) == want.strip()
            or str(get(r, path.strip())) == want.strip()
        ]
    return rows


def _columns(option: str | None) -> list[tuple[str, str, str | None]]:
    cols = []
    for col in _split(option):
        col, _, spec = col.partition("|")
        path, _, label = col.partition("=")
        cols.append((path.strip(), (label or path).strip(), spec.strip() or None))
    return cols


def render_rows(datas: list[tuple[str, Any]], options: dict) -> list[Table]:
    """Generic: one row per item of ``:rows:``, one column per ``:columns:`` entry.

    With several files, the rows of each are concatenated (``_file`` names the file)."""
    digits = int(options.get("digits", 4))
    cols = _columns(options.get("columns"))
    rows: list[Any] = []
    for name, data in datas:
        for item in _items(get(data, options.get("rows", "rows"))):
            if isinstance(item, dict):
                item = {"_file": name, **item}
            rows.append(item)
    rows = _where(rows, options.get("where"))
    if not cols:  # every scalar key of the first row
        cols = [
            (k, k, None)
            for k, v in rows[0].items()
            if not isinstance(v, (list, dict)) and k != "_file"
        ]
    return [
        Table(
            options.get("caption"),
            [c[1] for c in cols],
            [[_cell(r, p, s, digits) for p, _, s in cols] for r in rows],
        )
    ]


def parse_markdown_tables(text: str) -> list[Table]:
    """The pipe tables of a markdown string, each captioned by the heading above it."""
    tables: list[Table] = []
    title = None
    block: list[str] = []

    def flush():
        nonlocal block
        if len(block) >= 2:
            cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block]
            body = [r for r in cells[1:] if not all(set(c) <= set(":- ") for c in r)]
            tables.append(Table(title, cells[0], body))
        block = []

    for line in text.splitlines():
        if line.strip().startswith("|"):
            block.append(line)
            continue
        if block:
            flush()
            title = None
        if line.startswith("#"):
            title = line.lstrip("#").strip()
    flush()
    return tables


def render_markdown(datas: list[tuple[str, Any]], options: dict) -> list[Table]:
    """Tables the benchmark script wrote from its data as a markdown string in the JSON.

    ``:key:`` names the string (default: the first of ``tables_markdown``, ``table_markdown``,
    ``tables``, ``table``); ``:section:`` keeps the tables whose caption contains one of its
    comma-separated words; ``:tables:`` keeps tables by index (``0, 2``)."""
    out = []
    for _name, data in datas:
        key = options.get("key") or next(
            k
            for k in ("tables_markdown", "table_markdown", "tables", "table")
            if isinstance(data.get(k), str)
        )
        tables = parse_markdown_tables(get(data, key))
        if options.get("tables"):
            tables = [tables[int(i)] for i in _split(options["tables"])]
        if options.get("section"):
            words = _split(options["section"])
            tables = [t for t in tables if t.title and any(w in t.title for w in words)]
        out.extend(tables)
    return out


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
            for method, runs in seed["methods"].items():
                runs = runs if isinstance(runs, list) else runs.get("rows", [])
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
                rows.append(
                    [
                        name,
                        f"{method} one-shot",
                        "-",
                        fmt(m.get("mean_err"), ".2f"),
                        fmt(m.get("sd_err"), ".2f"),
                        fmt(m.get("seconds"), ".3g"),
                    ]
                )
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
    "check_refine": render_check_refine,
    "check_refine_rounds": render_check_refine_rounds,
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


# --- machine, wall time, command ----------------------------------------------------------


def machine_text(data: dict) -> str:
    """The machine a result file records, in one line."""
    m = _decode(data.get("machine"))
    parts: list[str] = []
    if isinstance(m, str):
        parts.append(m)
        m = {}
    m = dict(m or {})
    for k in ("cpus", "cpu_count", "jax", "device", "devices", "backend", "processor"):
        if k in data and k not in m:
            m[k] = data[k]

    def text(v):
        v = _decode(v)
        if isinstance(v, dict):
            return " ".join(str(v[k]) for k in ("system", "release", "machine") if v.get(k))
        return str(v)

    plat = m.get("platform") or m.get("uname") or m.get("processor")
    if plat:
        parts.append(text(plat))
    if m.get("processor") and text(m["processor"]) != text(plat):
        parts.append(text(m["processor"]))
    cpus = m.get("cpus") or m.get("cpu_count")
    if cpus:
        used = m.get("cpus_used")
        parts.append(f"{cpus} CPUs" + (f" ({used} used)" if used else ""))
    for key in ("device", "devices", "backend", "jax_devices", "gpu"):
        if m.get(key):
            parts.append(f"{key} {fmt(m[key])}")
    for lib in ("python", "jax", "numpyro", "optax", "torch", "pyro", "flwr"):
        v = m.get(lib) or (data.get(lib) if lib == "flwr" else None)
        if v:
            parts.append(f"{lib} {v}")
    for key in ("float64", "x64"):
        if key in m:
            parts.append("float64" if m[key] else "float32")
    return "; ".join(parts) or "not recorded"


def wall_seconds(data: dict) -> float | None:
    for key in ("wall_seconds", "total_wall_s", "total_seconds", "seconds"):
        if isinstance(data.get(key), (int, float)):
            return float(data[key])
    return None


def script_commands(stem: str) -> list[str]:
    """The ``python benchmarks/...`` command lines of a benchmark script's docstring."""
    doc = ast.get_docstring(ast.parse((SCRIPTS / f"{stem}.py").read_text())) or ""
    out: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("python benchmarks/") or line.startswith("OPENBLAS_NUM_THREADS"):
            cmd = line
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd += "\n    " + lines[i].strip()
            out.append(re.sub(r"(\S)  +(--)", r"\1 \2", cmd))
        i += 1
    return out


# --- plots --------------------------------------------------------------------------------


@dataclass
class Series:
    label: str
    x: list[float]
    y: list[float]


@dataclass
class Plot:
    xlabel: str
    ylabel: str
    series: list[Series]
    logx: bool = False
    logy: bool = False
    hline: float | None = None


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


def draw(plot: Plot, path: Path) -> None:
    """Draw ``plot`` to the PNG ``path`` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for s in plot.series:
        ax.plot(s.x, s.y, marker="o", markersize=3, linewidth=1.4, label=s.label)
    if plot.hline is not None:
        ax.axhline(plot.hline, color="grey", linewidth=0.8, linestyle="--")
    if plot.logx:
        ax.set_xscale("log")
    if plot.logy:
        ax.set_yscale("log")
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# --- finding the directives of a page (for the test) --------------------------------------

_DIRECTIVE = re.compile(
    r"^```\{(bench-table|bench-plot|bench-info)\}[ \t]*(.*)\n((?::[\w-]+:.*\n)*)", re.M
)


def find_directives(text: str) -> list[tuple[str, list[str], dict]]:
    """``(name, files, options)`` of every benchmark directive in a MyST page's text."""
    out = []
    for m in _DIRECTIVE.finditer(text):
        opts = {}
        for line in m.group(3).splitlines():
            k, _, v = line[1:].partition(":")
            opts[k.strip()] = v.strip()
        out.append((m.group(1), m.group(2).split(), opts))
    return out


# --- Sphinx -------------------------------------------------------------------------------


def _directives():
    from docutils import nodes
    from docutils.parsers.rst import directives
    from sphinx.util.docutils import SphinxDirective

    def inline(text: str) -> list:
        # backticks -> literals; emphasis markers dropped
        out = []
        for i, part in enumerate(re.split(r"`([^`]*)`", text.replace("**", ""))):
            if i % 2:
                out.append(nodes.literal(part, part))
            elif part:
                out.append(nodes.Text(part))
        return out

    def table_node(t: Table):
        ncols = max([len(t.header)] + [len(r) for r in t.rows])
        table = nodes.table(classes=["bench-table"])
        if t.title:
            table += nodes.title("", "", *inline(t.title))
        tgroup = nodes.tgroup(cols=ncols)
        table += tgroup
        for _ in range(ncols):
            tgroup += nodes.colspec(colwidth=1)
        thead, tbody = nodes.thead(), nodes.tbody()
        tgroup += thead
        tgroup += tbody
        for parent, cells_rows in ((thead, [t.header]), (tbody, t.rows)):
            for cells in cells_rows:
                row = nodes.row()
                for c in list(cells) + [""] * (ncols - len(cells)):
                    entry = nodes.entry()
                    entry += nodes.paragraph("", "", *inline(c))
                    row += entry
                parent += row
        return table

    class _Base(SphinxDirective):
        required_arguments = 1
        optional_arguments = 20
        final_argument_whitespace = False

        def files(self) -> list[str]:
            for f in self.arguments:
                path = result_path(f)
                if not path.exists():
                    raise self.error(f"no result file benchmarks/results/{f}")
                self.env.note_dependency(str(path))
            return list(self.arguments)

    class BenchTable(_Base):
        option_spec: ClassVar[dict] = {
            k: directives.unchanged
            for k in (
                "renderer",
                "rows",
                "columns",
                "where",
                "digits",
                "key",
                "section",
                "tables",
                "caption",
            )
        }

        def run(self):
            files = self.files()
            try:
                tables = render(files, dict(self.options))
            except Exception as exc:  # a renderer that does not fit its file fails the build
                raise self.error(f"bench-table {files}: {type(exc).__name__}: {exc}") from exc
            if not tables or not any(t.rows for t in tables):
                raise self.error(f"bench-table {files}: empty table")
            return [table_node(t) for t in tables]

    class BenchPlot(_Base):
        option_spec: ClassVar[dict] = {
            k: directives.unchanged
            for k in (
                "plotter",
                "rows",
                "x",
                "y",
                "group",
                "where",
                "log",
                "xlabel",
                "ylabel",
                "metric",
                "seed",
                "alt",
                "caption",
            )
        }

        def run(self):
            files = self.files()
            opts = dict(self.options)
            try:
                plot = plot_series(files, opts)
                tag = re.sub(
                    r"[^\w.-]+",
                    "-",
                    "_".join([opts["plotter"], opts.get("metric", ""), opts.get("y", ""), *files]),
                )
                name = f"{tag[:120]}.png"
                draw(plot, GENERATED / name)
            except Exception as exc:
                raise self.error(f"bench-plot {files}: {type(exc).__name__}: {exc}") from exc
            image = nodes.image(
                uri=f"/benchmarks/_generated/{name}", alt=opts.get("alt", opts.get("caption", ""))
            )
            if opts.get("caption"):
                figure = nodes.figure("", image)
                figure += nodes.caption("", "", *inline(opts["caption"]))
                return [figure]
            return [image]

    class BenchInfo(_Base):
        has_content = True
        option_spec: ClassVar[dict] = {"script": directives.unchanged}

        def run(self):
            files = self.files()
            items = nodes.bullet_list(classes=["bench-info"])

            def add(label, *body):
                item = nodes.list_item()
                para = nodes.paragraph("", "", nodes.strong(label, label), nodes.Text(" "))
                for b in body:
                    para += b
                item += para
                items.append(item)

            for f in files:
                data = load(f)
                secs = wall_seconds(data)
                wall = ""
                if secs is not None:
                    wall = (
                        f" (wall time {secs / 60:.1f} min)"
                        if secs >= 120
                        else f" (wall time {secs:.0f} s)"
                    )
                add(
                    "Result file:",
                    nodes.literal(f"benchmarks/results/{f}", f"benchmarks/results/{f}"),
                    nodes.Text(wall + "; machine: " + machine_text(data)),
                )
            commands = list(self.content) if self.content else []
            if not commands and self.options.get("script"):
                commands = script_commands(self.options["script"])
                self.env.note_dependency(str(SCRIPTS / f"{self.options['script']}.py"))
            out = [items]
            if commands:
                text = "\n".join(commands)
                out.append(nodes.paragraph("", "", nodes.strong("Command:", "Command:")))
                out.append(nodes.literal_block(text, text, language="bash"))
            return out

    return BenchTable, BenchPlot, BenchInfo


def setup(app):
    table, plot, info = _directives()
    app.add_directive("bench-table", table)
    app.add_directive("bench-plot", plot)
    app.add_directive("bench-info", info)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
