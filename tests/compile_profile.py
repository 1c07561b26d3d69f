"""Where the suite's time goes, per test file: ``pytest -p tests.compile_profile`` (with or
without ``-n``) records for every test its wall time, the CPU of its process and of the child
processes it waited for, and JAX's own compile events (seconds tracing to a jaxpr, lowering to
MLIR, compiling with XLA, and how many programs XLA compiled), then prints the files that took
longest and writes every test's row to ``$FEDPPL_PROFILE_DIR`` (default ``.pytest_profile``),
one JSON file per process. JAX's tracing events nest (a program traced inside another is
counted in both), so the tracing column over-counts. ``docs/design/suite.md`` reads a full run.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path

import pytest

#: JAX's monitoring events and the columns they go to
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "xla"}
COLUMNS = ("wall", "cpu", "child_cpu", "trace", "lower", "xla", "programs")

_seconds: collections.Counter = collections.Counter()
_rows: list[dict] = []


def _out() -> Path:
    return Path(os.environ.get("FEDPPL_PROFILE_DIR", ".pytest_profile"))


def _on_event(event: str, seconds: float, **_) -> None:
    if event in EVENTS:
        _seconds[EVENTS[event]] += seconds
        if EVENTS[event] == "xla":
            _seconds["programs"] += 1


def _name(config) -> str:
    """This process's name: an xdist worker's id, else "main" (read from the run's own
    configuration, not the environment, which a run started inside a worker inherits)."""
    return getattr(config, "workerinput", {}).get("workerid", "main")


def _cpu() -> tuple[float, float]:
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_event)
    if _name(config) == "main":  # the controller (or a run without workers)
        _out().mkdir(exist_ok=True)
        for old in _out().glob("profile_*.json"):
            old.unlink()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, (cpu, child), start = dict(_seconds), _cpu(), time.perf_counter()
    yield
    cpu_after, child_after = _cpu()
    _rows.append({"test": item.nodeid, "wall": time.perf_counter() - start,
                  "cpu": cpu_after - cpu, "child_cpu": child_after - child,
                  **{k: v - before.get(k, 0) for k, v in _seconds.items()}})


def pytest_sessionfinish(session):
    if _rows:
        (_out() / f"profile_{_name(session.config)}.json").write_text(json.dumps(_rows))


def by_file(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each column summed over each file's tests."""
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        files[row["test"].split("::")[0]].update({k: row.get(k, 0) for k in COLUMNS})
    return {f: dict(c) for f, c in files.items()}


def pytest_terminal_summary(terminalreporter, config):
    if _name(config) != "main":
        return
    rows = [r for f in sorted(_out().glob("profile_*.json")) for r in json.loads(f.read_text())]
    if not rows:
        return
    files = by_file(rows)
    total = {k: sum(f[k] for f in files.values()) for k in COLUMNS}
    write = terminalreporter.write_line
    terminalreporter.section("where the time went (tests.compile_profile)")
    write(" ".join(f"{k:>9}" for k in COLUMNS) + "  file")
    slowest = sorted(files.items(), key=lambda kv: -kv[1]["wall"])[:25]
    for name, f in [*slowest, ("all", total)]:
        write(" ".join(f"{f[k]:9.0f}" if k == "programs" else f"{f[k]:9.1f}" for k in COLUMNS)
              + f"  {name}")
    write(f"every test's row: {_out()}/profile_*.json")
