"""Each process group's CPU seconds and memory on Linux, read from ``/proc`` (for the Flower
benchmarks, whose local deployments start every process in a group of its own).

Memory is the proportional set size (PSS: a page shared by n processes counts 1/n to each, so
the sizes add up to what the machine holds), or the resident size where the kernel does not
give it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _pss_gib(pid: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def group_usage(procs: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """``{name: (GiB, CPU seconds)}`` of the process group led by each of ``procs`` (name to an
    object with a ``pid``), summed over the group's processes."""
    groups = {p.pid: name for name, p in procs.items()}
    out = dict.fromkeys(groups.values(), (0.0, 0.0))
    page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pgid, cpu, rss = int(fields[2]), int(fields[11]) + int(fields[12]), int(fields[21])
        except (OSError, ValueError, IndexError):
            continue
        if pgid in groups:
            pss = _pss_gib(stat.parent.name)
            gib, seconds = out[groups[pgid]]
            out[groups[pgid]] = (gib + (rss * page / 2**30 if pss is None else pss),
                                 seconds + cpu / tick)
    return out
