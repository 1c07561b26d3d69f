"""Generated gallery sources: the tutorials, and one executable page per gallery model."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def generate(srcdir: Path, write) -> None:
    """Copy the tutorials into ``gallery/tutorials``; write ``gallery/models/<name>.md``."""
    for script in sorted((ROOT / "tutorials").glob("*.py")):
        write(srcdir / "gallery" / "tutorials" / script.name, script.read_text())
