"""The benchmark suite's registry: every ``benchmarks/*.py`` that declares a ``BENCHMARK``.

A script joins the suite by declaring, at module level, a literal dict (read with ``ast``, so
listing the suite imports nothing heavy)::

    BENCHMARK = {
        "summary": "one line on what it measures",
        "data": "../shared/data/uci",          # what it reads (a path from the repository
                                               # root, or None: generated or bundled data)
        "quick": ["--quick"],                  # arguments of a quick run (minutes at most)
        "full": [[], ["--clients", "100", "--out", "benchmarks/results/x_k100.json"]],
        "cost": "quick ~1 min; full ~40 min",  # rough, on the 2-core CPU machine
    }

``full`` lists the runs that wrote the committed results (each an argument list; a run without
``--out`` writes the script's default file). A quick run gets ``--out
benchmarks/results/quick/NAME.json`` (``"out": None`` in ``BENCHMARK`` for a script without
``--out``), so it never replaces a committed result. Files whose names start with ``_`` are
not benchmarks. A script that declares nothing is still listed (its docstring's first line),
and runs quick with ``--quick --out ...`` if its source names both options; otherwise it has
no quick run and ``all --size quick`` skips it, saying so.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
QUICK_RESULTS = HERE / "results" / "quick"


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: Path
    summary: str
    data: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    full: tuple[tuple[str, ...], ...] = ((),)
    cost: str = "not stated"
    out: str | None = "--out"
    has_quick: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def missing_data(self) -> list[str]:
        """The data paths this benchmark reads that are absent on this machine."""
        return [d for d in self.data if not (ROOT / d).exists()]

    def quick_out(self) -> Path:
        return QUICK_RESULTS / f"{self.name}.json"

    def commands(self, size: str) -> list[list[str]]:
        """The argument lists (after ``python benchmarks/NAME.py``) of a run at ``size``."""
        if size == "full":
            return [list(args) for args in self.full]
        args = list(self.quick)
        if self.out and self.out not in args:
            args += [self.out, str(self.quick_out().relative_to(ROOT))]
        return [args]


def declared(path: Path) -> dict[str, Any] | None:
    """The ``BENCHMARK`` literal of a script, or None if it declares none."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and target.id == "BENCHMARK":
            return ast.literal_eval(value)
    return None


def _tuple(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def undeclared(path: Path) -> dict[str, Any]:
    """What a script without ``BENCHMARK`` gets: its docstring's first line as the summary, a
    quick run with ``--quick`` and ``--out`` where its source names both (else none)."""
    source = path.read_text()
    doc = ast.get_docstring(ast.parse(source)) or path.stem
    quick_ok = '"--quick"' in source and '"--out"' in source
    return {"summary": doc.splitlines()[0] + " (declares no BENCHMARK: defaults assumed)",
            "quick": ["--quick"] if quick_ok else None, "full": [[]],
            "cost": "not stated" + ("" if quick_ok else "; no quick run (no --quick and --out)")}


def load(path: Path) -> Benchmark | None:
    spec = declared(path)
    if spec is None:
        if path.name == "__main__.py":
            return None
        spec = undeclared(path)
    known = {"summary", "data", "quick", "full", "cost", "out"}
    full = spec.get("full", [[]])
    return Benchmark(
        name=path.stem,
        path=path,
        summary=spec["summary"],
        data=_tuple(spec.get("data")),
        quick=_tuple(spec.get("quick")),
        has_quick=spec.get("quick") is not None,
        full=tuple(_tuple(a) for a in full) or ((),),
        cost=spec.get("cost", "not stated"),
        out=spec.get("out", "--out"),
        extra={k: v for k, v in spec.items() if k not in known},
    )


def benchmarks() -> dict[str, Benchmark]:
    """Every registered benchmark by name, in name order."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        bench = load(path)
        if bench is not None:
            out[bench.name] = bench
    return out


def describe(suite: dict[str, Benchmark]) -> str:
    """The text of ``python -m benchmarks --list``."""
    lines = []
    for b in suite.values():
        lines.append(b.name)
        lines.extend(textwrap.wrap(b.summary, 92, initial_indent="    ",
                                   subsequent_indent="    "))
        data = ", ".join(b.data) if b.data else "none (generated or bundled with a library)"
        lines.append(f"    data: {data}")
        lines.append(f"    cost: {b.cost}")
    lines.append(f"\n{len(suite)} benchmarks; python -m benchmarks NAME [--size quick|full]")
    return "\n".join(lines)
