"""Who runs the algorithms: the embedded (single-process, vmapped) runtime."""

from fedppl.runtime.embedded import SCHEDULES, make_round

__all__ = ["make_round", "SCHEDULES"]
