"""Benchmark pages: tables and plots generated from ``benchmarks/results/*.json``.

Three MyST directives, so that a benchmark page cannot disagree with its result files (the
files are read when the page is built, and registered as the page's dependencies: a changed
result rebuilds the page):

``bench-info``
    The result file(s), the machine and the wall time recorded in them, the command, commit and
    date each recorded ("not recorded" where an older file lacks one), and the command that
    reproduces them: the directive's content, or (``:script: STEM``) the ``python
    benchmarks/...`` lines of the benchmark script's docstring::

        ```{bench-info} pvi_rounds.json
        :script: pvi_rounds
        ```

``bench-table``
    One or more tables from one or more result files (names relative to
    ``benchmarks/results/``). ``:renderer:`` picks the renderer
    (:data:`benchrenderers.RENDERERS`); the generic ``rows`` renderer takes ``:rows:`` (a dotted
    path to a list or dict in the JSON),
    ``:columns:`` (comma-separated ``path=Label|format``; ``a±b`` for "a ± b"), ``:where:``
    (``path=value`` filters, comma-separated) and ``:digits:`` (significant digits)::

        ```{bench-table} pvi_rounds.json
        :rows: results
        :columns: K, vmap=vmap s/round, loop=loop s/round, ratio_loop_over_vmap=loop / vmap|.1f
        ```

``bench-plot``
    A matplotlib figure (:data:`benchrenderers.PLOTS`) drawn at build time into
    ``docs/benchmarks/_generated/`` (git-ignored).

This module holds the directives and the drawing; the data side (:mod:`benchdata`: reading,
generic tables, machine and command; :mod:`benchrenderers`: one renderer per result schema)
imports neither Sphinx nor matplotlib, so ``tests/test_docs_benchpages.py`` checks every page's
tables in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

from benchdata import (
    GENERATED,
    NOT_RECORDED,
    SCRIPTS,
    Plot,
    Table,
    load,
    machine_text,
    provenance_text,
    result_path,
    script_commands,
    wall_seconds,
)
from benchrenderers import plot_series, render


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



def plot_name(files: list[str], options: dict) -> str:
    """The PNG file name (under ``docs/benchmarks/_generated/``) of a ``bench-plot``."""
    tag = re.sub(
        r"[^\w.-]+",
        "-",
        "_".join([options["plotter"], options.get("metric", ""), options.get("y", ""), *files]),
    )
    return f"{tag[:120]}.png"


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
                name = plot_name(files, opts)
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
                rec = provenance_text(data)
                command = (
                    [nodes.Text(rec["command"])]
                    if rec["command"] == NOT_RECORDED
                    else [nodes.literal(rec["command"], rec["command"])]
                )
                add(
                    "Recorded:",
                    nodes.Text("command "),
                    *command,
                    nodes.Text(f"; commit {rec['commit']}; date {rec['date']}"),
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
