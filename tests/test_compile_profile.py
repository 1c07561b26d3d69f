"""The suite's profiler (``pytest -p tests.compile_profile``) on a small run of its own: a test
that compiles one program and one that compiles none, each row with its own figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.compile_profile import by_file

ROOT = Path(__file__).resolve().parent.parent


def test_rows_and_summary(tmp_path):
    (tmp_path / "test_small.py").write_text(
        "import jax, jax.numpy as jnp\n\n"
        "def test_compiles():\n"
        "    assert float(jax.jit(lambda x: jnp.sin(x) + 3.0)(0.5)) > 3\n\n"
        "def test_does_not():\n"
        "    assert sum(range(4)) == 6\n")
    out = tmp_path / "profile"
    # a run of its own even inside an xdist worker (whose variables it would inherit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env |= {"FEDPPL_PROFILE_DIR": str(out),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "tests.compile_profile", "test_small.py"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "where the time went" in run.stdout and "test_small.py" in run.stdout
    rows = {r["test"].split("::")[1]: r for r in
            json.loads((out / "profile_main.json").read_text())}
    assert rows["test_compiles"]["programs"] >= 1 and rows["test_compiles"]["xla"] > 0
    assert rows["test_compiles"]["trace"] > 0 and rows["test_compiles"]["lower"] > 0
    assert rows["test_does_not"].get("programs", 0) == 0
    assert all(r["wall"] >= 0 and r["cpu"] >= 0 for r in rows.values())
    files = by_file(list(rows.values()))
    assert list(files) == ["test_small.py"]
    assert files["test_small.py"]["programs"] == rows["test_compiles"]["programs"]
