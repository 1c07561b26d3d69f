from __future__ import annotations

import numpy as np
import pytest

from fedppl.cli import main
from fedppl_experiments import cotraining_study as study
from tests.test_cli import assert_cli_json


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


def test_parties_of_maps_a_problem_onto_clients_and_keywords():
    p = study.parties_of(study._problem(study.Config(n_obs=7, seed=2)))
    assert p.clients.names == ("party 0", "party 1") and p.clients.sizes.tolist() == [7, 7]
    assert [a.shape for a in p.pool] == [(500, 1), (500, 1)] and p.y_test.shape == (500,)


def test_cli_cotrain_with_dp(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["cotrain", "--masked", "--dp", "--rounds", "2", "--n-obs", "15", "--json",
                 str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "| 1 |" in text and "epsilon" in text
    (res,) = assert_cli_json(out, "cotrain")
    assert res["config"]["dp"] is True and res["method"] == "cotraining"
    assert res["config"]["rounds"] == 2 and res["config"]["delta"] == 0.00625
    assert all(e > 0 for e in res["summary"]["epsilon"])
    assert res["history"]["round"] == [1, 2] and len(res["history"]["epsilon"]) == 2


@pytest.mark.parametrize("flags,match", [
    (["--rounds", "0"], "--rounds: must be a positive integer"),
    (["--n-obs", "-3"], "--n-obs: must be a positive integer"),
    (["--dp", "--epsilon", "0"], "--epsilon: must be a positive"),
    (["--dp", "--delta", "2"], "--delta: must lie in (0, 1)"),
    (["--r", "1.5"], "--r: must lie in (0, 1)"),
])
def test_cli_cotrain_refuses_bad_flags(flags, match, capsys):
    with pytest.raises(SystemExit) as info:
        main(["cotrain", *flags])
    assert info.value.code == 2 and match in capsys.readouterr().err
