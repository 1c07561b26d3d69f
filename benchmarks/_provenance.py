"""Where a result came from: the command, machine, commit and date every results file records.

Every benchmark script passes the dict it is about to write through :func:`stamp`, which adds
the four fields it does not set itself (a script's own richer ``machine`` is kept)::

    from _provenance import stamp
    path.write_text(json.dumps(stamp(report), indent=1))

The scripts run as ``python benchmarks/NAME.py`` (so ``benchmarks/`` is on ``sys.path``) or
through ``python -m benchmarks NAME``, which runs them the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_LIBRARIES = ("jax", "jaxlib", "numpyro", "optax", "torch", "pyro-ppl", "flwr")


def command() -> str:
    """The command line that ran this process, as one would type it from the repository root."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if script is not None and script.is_file():
        try:
            first = str(script.relative_to(ROOT))
        except ValueError:
            first = str(script)
        return shlex.join(["python", first, *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def commit() -> dict[str, Any] | None:
    """The checkout's HEAD and whether its library or benchmark sources had uncommitted edits."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "fedppl", "fedppl_experiments", "benchmarks",
             "examples"], capture_output=True, text=True, cwd=ROOT, check=True, timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": head, "uncommitted_edits": bool(dirty)}


def machine() -> dict[str, Any]:
    """The platform, the CPUs, the JAX backend (if JAX is loaded) and the library versions."""
    out: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor(),
                           "cpu_count": os.cpu_count(), "python": platform.python_version()}
    for lib in _LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[lib] = metadata.version(lib)
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            out["devices"] = str(jax.devices())
            out["float64"] = bool(jax.config.jax_enable_x64)
        except Exception:
            pass
    if os.environ.get("XLA_FLAGS"):
        out["xla_flags"] = os.environ["XLA_FLAGS"]
    return out


def provenance() -> dict[str, Any]:
    """``command``, ``machine``, ``commit`` and ``date`` (UTC, ISO 8601) of this run."""
    return {"command": command(), "machine": machine(), "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def stamp(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with the provenance fields it lacks added in front (what it sets is kept)."""
    return {**provenance(), **report}
