"""The benchmark suite's one command.

    python -m benchmarks --list                    # each benchmark: what, data, cost
    python -m benchmarks NAME [NAME ...]           # quick runs (the default size)
    python -m benchmarks NAME --size full          # the runs behind the committed results
    python -m benchmarks all --size quick          # every benchmark, one after the other
    python -m benchmarks pages                     # the docs' benchmark pages from the results
    python -m benchmarks NAME -- ARGS              # ARGS appended to each of NAME's commands

A run is ``python benchmarks/NAME.py ARGS`` from the repository root, in its own process, with
the arguments the script declares in its ``BENCHMARK`` (see ``benchmarks/_registry.py``). Quick
runs write to ``benchmarks/results/quick/`` (git-ignored) and never replace the committed
results the docs cite; full runs write the committed files, and ``pages`` renders every
benchmark page's tables and plots from them (``make docs`` builds the site). A benchmark whose
data (under ``../shared/data``) is absent is skipped with the path it needs. Each run's status
and seconds go to ``benchmarks/results/quick/runs.json`` (or ``full_runs.json`` beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import provenance
from _registry import QUICK_RESULTS, ROOT, Benchmark, benchmarks, describe


def _stop(proc: subprocess.Popen) -> None:
    """Stop a run's process group: SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(b: Benchmark, size: str, timeout: float | None, dry_run: bool,
            extra: list[str] | None = None) -> dict:
    """Run ``b`` at ``size`` (each of its commands), or say why it was skipped."""
    row: dict = {"name": b.name, "size": size, "commands": [], "seconds": 0.0}
    missing = b.missing_data()
    if size == "quick" and not b.has_quick:
        row.update(status="skipped", reason="no quick run declared (BENCHMARK in the script)")
        print(f"[{b.name}] skipped: {row['reason']}", flush=True)
        return row
    if missing:
        row.update(status="skipped", reason="data not found: " + ", ".join(
            str((ROOT / m).resolve()) for m in missing))
        print(f"[{b.name}] skipped: {row['reason']}", flush=True)
        return row
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    for args in b.commands(size):
        cmd = [sys.executable, str(b.path.relative_to(ROOT)), *args, *(extra or [])]
        shown = shlex.join(["python", *cmd[1:]])
        row["commands"].append(shown)
        print(f"[{b.name}] {shown}", flush=True)
        if dry_run:
            continue
        start = time.perf_counter()
        # its own process group, so that a timeout stops the processes it started too
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            _stop(proc)
            if isinstance(exc, KeyboardInterrupt):
                raise
            row["seconds"] += time.perf_counter() - start
            row.update(status="timeout", reason=f"stopped after {timeout:.0f} s")
            return row
        row["seconds"] += time.perf_counter() - start
        if returncode:
            row.update(status="failed", reason=f"exit status {returncode}")
            return row
    row["status"] = "dry run" if dry_run else "ran"
    return row


def pages() -> int:
    """Render every benchmark page's tables and plots from the results (no Sphinx build)."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import benchdata as bd
    import benchpages as bp
    import benchrenderers as br

    problems = n = 0
    for page in sorted((ROOT / "docs" / "benchmarks").glob("*.md")):
        for name, files, options in bd.find_directives(page.read_text()):
            n += 1
            try:
                if any(not bd.result_path(f).is_file() for f in files):
                    raise FileNotFoundError(f"no result file among {files}")
                if name == "bench-table":
                    if not any(t.rows for t in br.render(files, options)):
                        raise ValueError("empty table")
                elif name == "bench-plot":
                    bp.draw(br.plot_series(files, options),
                            bd.GENERATED / bp.plot_name(files, options))
                else:
                    for f in files:
                        bd.machine_text(bd.load(f))
            except Exception as exc:
                problems += 1
                print(f"{page.name}: {name} {' '.join(files)}: {type(exc).__name__}: {exc}")
    print(f"{n} tables, plots and result notes on the benchmark pages; {problems} problems"
          + ("" if problems else "; `make docs` builds the site from them"))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:  # arguments after -- go to every command of the run
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    suite = benchmarks()
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:9]))
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="benchmarks to run, 'all', or 'pages' (see --list)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--size", choices=("quick", "full"), default="quick")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per command before it is stopped")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = p.parse_args(argv)
    if a.list or not a.names:
        print(describe(suite))
        return 0
    if a.names == ["pages"]:
        return pages()
    names = list(suite) if a.names == ["all"] else a.names
    unknown = [n for n in names if n not in suite]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; --list shows them")
    rows = [run_one(suite[n], a.size, a.timeout, a.dry_run, extra) for n in names]
    print("\n| benchmark | size | status | seconds | note |\n|---|---|---|---:|---|")
    for r in rows:
        print(f"| {r['name']} | {r['size']} | {r['status']} | {r['seconds']:.0f} "
              f"| {r.get('reason', '')} |")
    if not a.dry_run:
        log = QUICK_RESULTS / ("runs.json" if a.size == "quick" else "full_runs.json")
        log.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(log.read_text())["runs"] if log.exists() else []
        done = {r["name"] for r in rows}
        log.write_text(json.dumps({**provenance(), "runs": [r for r in old if r["name"]
                                                            not in done] + rows}, indent=1))
    return 0 if all(r["status"] in ("ran", "skipped", "dry run") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
