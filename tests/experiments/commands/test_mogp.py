from __future__ import annotations

import pytest

from fedppl.cli import main
from tests.test_cli import assert_cli_json


def test_digits_command_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["mogp", "--study", "digits", "--method", "pfed-mul", "--shots", "5",
                 "--clients", "3", "--rounds", "2", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "| pfed-mul |" in text and "accuracy" in text
    (run,) = assert_cli_json(out, "mogp")
    res = run["summary"]
    assert run["method"] == "pfed-mul" and run["config"]["clients"] == 3
    assert 0.0 <= res["accuracy"] <= 1.0 and res["mse"] > 0
    assert run["history"]["round"] == [1, 2] and len(run["history"]["accuracy"]) == 2


def test_unknown_method_is_rejected(capsys):
    with pytest.raises(SystemExit) as info:
        main(["mogp", "--method", "fedavg", "--no-progress"])
    assert info.value.code == 2 and "invalid choice 'fedavg'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rounds", "--shots", "--clients"])
def test_non_positive_counts_are_rejected(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["mogp", flag, "0", "--no-progress"])
    assert info.value.code == 2
    assert f"{flag}: must be a positive integer, got '0'" in capsys.readouterr().err
