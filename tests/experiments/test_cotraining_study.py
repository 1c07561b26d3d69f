from __future__ import annotations

import json

import numpy as np
import pytest

from fedppl.cli import main
from fedppl_experiments import cotraining_study as study


@pytest.fixture(scope="module")
def rows():
    return [study.run_one(study.Config("noisy", u, masked=m, r=0.9, n_obs=15, seed=0),
                          rounds=2, fit_steps=40)
            for u in ("none", "full") for m in (False, True)]


def test_rows_record_both_parties_before_and_after(rows):
    for r in rows:
        assert len(r["rmse_before"]) == len(r["rmse_after"]) == 2
        assert r["rmse"] == pytest.approx(np.mean(r["rmse_after"]))
        assert r["epsilon"] == [None, None]


def test_stratified_table_layout(rows):
    text = study.stratified_table(rows, ["masked"], columns="uncertainty")
    lines = text.splitlines()
    assert lines[0] == "| masked | none | full |"
    assert lines[2].startswith("| False | ") and lines[3].startswith("| True | ")
    before = study.stratified_table(rows, ["masked"], value="rmse_before_0")
    assert "±" in before


def test_grid_is_the_full_factorial():
    g = study.grid(rs=[0.5], n_obs=[25], seeds=range(2))
    assert len(g) == 3 * 3 * 2 * 2 * 1 * 1 * 2 * 2
    assert len(set(g)) == len(g)


def test_cli_cotrain_with_dp(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["cotrain", "--masked", "--dp", "--rounds", "2", "--n-obs", "15", "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 1 |" in text and "epsilon" in text
    row = json.loads(out.read_text())
    assert row["dp"] is True and all(e > 0 for e in row["epsilon"])
