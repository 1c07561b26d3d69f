from __future__ import annotations

import argparse
import json

import pytest

from fedppl_experiments.commands import mogp as cmd


def _parse(argv):
    p = argparse.ArgumentParser()
    cmd.register(p.add_subparsers(dest="command"))
    return p.parse_args(argv)


def test_digits_command_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = _parse(["mogp", "--study", "digits", "--method", "pfed-mul", "--shots", "5",
                   "--clients", "3", "--rounds", "2", "--json", str(out), "--no-progress"])
    cmd.run(args)
    text = capsys.readouterr().out
    assert "| pfed-mul |" in text and "accuracy" in text
    res = json.loads(out.read_text())["results"]["pfed-mul"]
    assert 0.0 <= res["accuracy"] <= 1.0 and len(res["acc_curve"]) == 2 and res["mse"] > 0


def test_unknown_method_is_rejected():
    with pytest.raises(SystemExit, match="unknown method"):
        cmd.run(_parse(["mogp", "--method", "fedavg", "--no-progress"]))


@pytest.mark.parametrize("flag", ["--rounds", "--shots", "--clients"])
def test_non_positive_counts_are_rejected(flag):
    with pytest.raises(SystemExit, match=f"{flag} must be a positive integer, got 0"):
        cmd.run(_parse(["mogp", flag, "0", "--no-progress"]))
