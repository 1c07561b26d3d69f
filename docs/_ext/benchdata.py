"""The data side of the benchmark pages: reading ``benchmarks/results/*.json``, the generic
tables (``rows``: a list or dict of the JSON; ``markdown``: the tables a script wrote), the
machine, wall time, command, commit and date a result records ("not recorded" where an older
file lacks one), the plot types, and the directives of a page.

It imports neither Sphinx nor matplotlib, so ``tests/test_docs_benchpages.py`` checks every
page's tables without a build.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


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


NOT_RECORDED = "not recorded"


def commit_text(data: dict) -> str:
    """The commit a result records (its short hash, and whether the sources had uncommitted
    edits), wherever the file keeps it; "not recorded" where it does not."""
    m = _decode(data.get("machine"))
    m = m if isinstance(m, dict) else {}
    for c in (data.get("commit"), data.get("git_commit"), m.get("commit"), m.get("git_commit")):
        c = _decode(c)
        if isinstance(c, dict) and c.get("sha"):
            edits = " (with uncommitted edits)" if c.get("uncommitted_edits") else ""
            return str(c["sha"])[:10] + edits
        if isinstance(c, str) and c:
            return c[:10]
    return NOT_RECORDED


def provenance_text(data: dict) -> dict[str, str]:
    """The command, commit and date a result records, each "not recorded" where absent."""
    command, date = data.get("command"), data.get("date")
    return {"command": command if isinstance(command, str) and command else NOT_RECORDED,
            "commit": commit_text(data),
            "date": date if isinstance(date, str) and date else NOT_RECORDED}


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
