"""``fedppl demo --ppl pyro``: the NumPyro demo's table and plot from the Pyro port (small run)."""

from __future__ import annotations

from fedppl.cli import main
from tests.test_cli import assert_cli_json


def test_pyro_demo_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    out, table = tmp_path / "demo.png", tmp_path / "demo.json"
    assert main(["demo", "--ppl", "pyro", "--clients", "3", "--rounds", "1", "--local-steps",
                 "8", "--out", str(out), "--json", str(table), "--no-progress"]) == 0
    text = capsys.readouterr().out
    for row in ["PVI sequential", "PVI synchronous", "global VI", "client alone", "fedppl.pyro"]:
        assert row in text
    assert out.stat().st_size > 10_000
    runs = assert_cli_json(table, "demo")
    assert all(r["config"]["ppl"] == "pyro" for r in runs)
    assert all(0.8 < r["summary"]["accuracy"] <= 1.0 for r in runs)
    assert runs[0]["history"]["round"] == [1]
