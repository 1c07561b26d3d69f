"""Tutorials are scripts; each must run to the end."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

TUTORIALS = sorted((Path(__file__).parent.parent / "tutorials").glob("*.py"))


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the figures they write land here, not in the checkout
    ns = runpy.run_path(str(path), run_name="__main__")
    if "result" in ns and "ref" in ns:  # the quickstart's claim: PVI lands on global VI
        (m, _), (mr, cr) = ns["result"].mean_and_cov(), ns["ref"].mean_and_cov()
        assert np.all(np.abs(m - mr) < 0.1 * np.sqrt(np.diag(cr)))
