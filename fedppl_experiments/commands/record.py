"""One run of an experiment subcommand as a record of the command line's JSON document
(:data:`fedppl.cli.JSON_SCHEMA`): plain types only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedppl.infer.base import plain

__all__ = ["run_record"]


def _column(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return plain(list(value))
    arr = np.asarray(value)
    return plain(arr) if arr.ndim else [plain(arr)]


def run_record(method: str, config: Mapping[str, Any], summary: Mapping[str, Any],
               history: Mapping[str, Any] | None = None,
               rejected: Sequence[Any] | None = None) -> dict[str, Any]:
    """One run in the JSON shape (plain types; ``history`` and ``rejected`` empty if ``None``)."""
    return {"method": str(method), "config": plain(dict(config)),
            "summary": plain(dict(summary)),
            "history": {str(k): _column(v) for k, v in (history or {}).items()},
            "rejected": [plain(list(r)) for r in (rejected or [])]}
