from __future__ import annotations

from pathlib import Path

import numpy as np
import optax
import pytest

from fedppl.cli import main
from fedppl.models.random_features import URKSpec
from fedppl_experiments import fedbnr_uci
from tests.test_cli import assert_cli_json


@pytest.fixture
def uci_folder(tmp_path: Path) -> Path:
    """A small dataset in the UCI folder layout (the real data are not needed here)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 3))
    y = 10 + 4 * np.sin(X[:, 0]) + X[:, 1] + 0.2 * rng.normal(size=300)
    np.savetxt(tmp_path / "data.txt", np.column_stack([X, y]))
    (tmp_path / "index_features.txt").write_text("0\n1\n2\n")
    (tmp_path / "index_target.txt").write_text("3\n")
    return tmp_path


def test_every_variant_reports_metrics_in_original_units(uci_folder):
    small = URKSpec(3, feature_widths=(6, 3), shift_widths=(), num_samples=10)
    rows = fedbnr_uci.run(str(uci_folder), 4, list(fedbnr_uci.VARIANTS), spec=small, rounds=2,
                          local_steps=5, kd_steps=5, optimizer=optax.adam(2e-2))
    assert set(rows) == set(fedbnr_uci.VARIANTS)
    for r in rows.values():
        assert {"rmse", "log_lik", "ece", "mce", "brier", "rounds_to_convergence"} <= set(r)
        assert 0 < r["rmse"] < 10 and 0 <= r["ece"] <= r["mce"] <= 1 and r["rounds"] == 2
    prep = fedbnr_uci.prepare(str(uci_folder), 4)
    assert prep.clients.sizes.sum() == 240 and len(prep.test[1]) == 30
    assert len(prep.kd_data[1]) == 24 and len(prep.kd_validation[1]) == 6


def test_cli_writes_json(uci_folder, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["fedbnr", "--data", str(uci_folder), "--clients", "3", "--method", "avg",
                 "--rounds", "2", "--local-steps", "3", "--json", str(out),
                 "--no-progress"]) == 0
    assert "| avg |" in capsys.readouterr().out
    (run,) = assert_cli_json(out, "fedbnr")
    assert run["method"] == "avg" and run["config"]["kernel"] == "avg"
    assert "rounds_to_convergence" in run["summary"] and run["summary"]["rmse"] > 0
    assert run["history"]["round"] == [1, 2]


@pytest.mark.parametrize("flags,message", [
    (["--rounds", "0"], "argument --rounds: must be a positive integer, got '0'"),
    (["--rounds", "2.5"], "argument --rounds: must be a positive integer"),
    (["--clients", "-1"], "argument --clients: must be a positive integer"),
    (["--local-steps", "0"], "argument --local-steps: must be a positive integer"),
    (["--kd-alpha", "-1"], "argument --kd-alpha: must be a non-negative"),
    (["--kd-alpha", "nan"], "argument --kd-alpha: must be a non-negative"),
])
def test_cli_refuses_bad_flags(uci_folder, flags, message, capsys):
    with pytest.raises(SystemExit):
        main(["fedbnr", "--data", str(uci_folder), *flags])
    assert message in capsys.readouterr().err


def test_cli_refuses_unknown_variants(uci_folder, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fedbnr", "--data", str(uci_folder), "--variant", "fedprox"])
    assert info.value.code == 2 and "invalid choice 'fedprox'" in capsys.readouterr().err


def test_unknown_variant(uci_folder):
    with pytest.raises(ValueError, match="unknown variants"):
        fedbnr_uci.run(str(uci_folder), 2, ["fedprox"])
