"""Who runs the algorithms: the embedded (single-process, vmapped) runtime, and the same with
injected faults (:class:`~fedppl.runtime.faults.Faults`)."""

from fedppl.runtime.embedded import SCHEDULES, Runtime, make_round
from fedppl.runtime.faults import Faults

__all__ = ["make_round", "Runtime", "SCHEDULES", "Faults"]
