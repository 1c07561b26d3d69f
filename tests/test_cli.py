from __future__ import annotations

import subprocess
import sys

from fedppl.cli import main


def test_demo_prints_table_and_writes_plot(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["demo", "--clients", "4", "--rounds", "2", "--local-steps", "30", "--out",
                 str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    for row in ["PVI sequential", "PVI synchronous", "global VI", "client alone"]:
        assert row in text
    assert out.stat().st_size > 10_000


def test_module_entry_point_shows_help():
    proc = subprocess.run([sys.executable, "-m", "fedppl", "--help"], capture_output=True,
                          text=True, check=True)
    assert "demo" in proc.stdout
