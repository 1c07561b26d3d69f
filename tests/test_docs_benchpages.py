"""The benchmark pages' tables and plots (``docs/_ext/benchdata.py``, ``benchrenderers.py``) fit
their result files.

No Sphinx build: every ``bench-table``, ``bench-plot`` and ``bench-info`` directive of
``docs/benchmarks/*.md`` is found in the page's text, its result files must exist, and its
renderer must give non-empty tables (its plotter non-empty series) from them. Every benchmark
script with result files has its page; result files are named by what they measure; the suite's
registry (``python -m benchmarks``) lists every script.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "benchmarks"
sys.path.insert(0, str(ROOT / "docs" / "_ext"))  # the site's extension modules

import benchdata as bd  # noqa: E402
import benchrenderers as br  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))  # the suite's registry (imports no benchmark)
import _registry as registry  # noqa: E402

DIRECTIVES = [
    (page.name, *d)
    for page in sorted(PAGES.glob("*.md"))
    for d in bd.find_directives(page.read_text())
]


def test_pages_have_directives():
    assert len(DIRECTIVES) > 40
    assert {d[1] for d in DIRECTIVES} == {"bench-table", "bench-plot", "bench-info"}


@pytest.mark.parametrize(
    "page,name,files,options",
    DIRECTIVES,
    ids=[f"{d[0]}:{d[1]}:{i}" for i, d in enumerate(DIRECTIVES)],
)
def test_directive(page, name, files, options):
    assert files, f"{page}: {name} names no result file"
    for f in files:
        assert bd.result_path(f).is_file(), f"{page}: no benchmarks/results/{f}"
    if name == "bench-table":
        tables = br.render(files, options)
        assert tables and all(t.header and t.rows for t in tables), (
            f"{page}: empty table from {files}"
        )
        for t in tables:
            assert all(any(c not in ("", "-") for c in row) for row in t.rows)
    elif name == "bench-plot":
        plot = br.plot_series(files, options)
        assert plot.series and all(s.x and len(s.x) == len(s.y) for s in plot.series)
        for s in plot.series:
            assert all(isinstance(v, (int, float)) for v in [*s.x, *s.y]), (
                f"{page}: {s.label} is not numeric"
            )
    else:
        for f in files:
            assert bd.machine_text(bd.load(f))
        if options.get("script"):
            assert bd.script_commands(options["script"]), (
                f"{page}: no command in {options['script']}.py"
            )


def test_every_benchmark_with_results_has_a_page():
    results = {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):
        if not any(r == script.stem or r.startswith(script.stem + "_") for r in results):
            continue
        assert (PAGES / f"{script.stem}.md").is_file(), (
            f"no page docs/benchmarks/{script.stem}.md for {script.name}"
        )


def test_result_names_say_what_they_measure():
    # named by task, method and settings: not by the issue or commit that produced them
    for p in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert not re.search(r"issue\d|_[0-9a-f]{7,}(_|$)", p.stem), p.name


def test_registry():
    """``python -m benchmarks --list`` reads every script's ``BENCHMARK`` without importing it;
    a quick run never writes a committed result."""
    suite = registry.benchmarks()
    assert {"pvi_rounds", "same_numbers", "check_refine"} <= set(suite)
    for b in suite.values():
        assert b.summary and b.cost and b.full, b.name
        for args in b.commands("quick"):
            if b.out:
                assert args[args.index(b.out) + 1].startswith("benchmarks/results/quick/"), b.name
        for d in b.data:
            assert d.startswith("../shared/data"), (b.name, d)
    text = registry.describe(suite)
    assert all(name in text for name in suite)


def test_provenance_not_invented():
    """A result without a command, commit or date shows "not recorded"; one with them shows
    them."""
    assert bd.provenance_text({}) == dict.fromkeys(("command", "commit", "date"), "not recorded")
    rec = bd.provenance_text(
        {"command": "python benchmarks/x.py", "date": "2026-01-01",
         "commit": {"sha": "0123456789abcdef", "uncommitted_edits": True}}
    )
    assert rec == {"command": "python benchmarks/x.py", "date": "2026-01-01",
                   "commit": "0123456789 (with uncommitted edits)"}
    assert bd.commit_text({"machine": {"git_commit": "fedcba9876543"}}) == "fedcba9876"


def test_every_result_file_is_on_a_page():
    shown = {f for d in DIRECTIVES for f in d[2]}
    missing = sorted(
        p.name for p in (ROOT / "benchmarks" / "results").glob("*.json") if p.name not in shown
    )
    assert not missing, f"result files on no benchmark page: {missing}"


def test_markdown_tables_parse():
    tables = bd.parse_markdown_tables(
        "### a\n\n| x | y |\n|---|---:|\n| 1 | 2 |\n\n| z |\n|---|\n| 3 |\n"
    )
    assert [(t.title, t.header, t.rows) for t in tables] == [
        ("a", ["x", "y"], [["1", "2"]]),
        (None, ["z"], [["3"]]),
    ]
