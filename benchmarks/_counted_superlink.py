"""Flower's SuperLink, counting the HTTP requests it serves by path (for
``flower_overhead.py``): the counts go as JSON to the file ``$FEDPPL_REQUEST_COUNTS`` every half
second. Flower's log filter sees every request uvicorn answers; it is wrapped to count them.

    python benchmarks/_counted_superlink.py [flower-superlink options]
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

from flwr.supercore import http_logging
from flwr.superlink.cli import flower_superlink

COUNTS: collections.Counter = collections.Counter()
_FILTER = http_logging.RoutineAccessFilter.filter


def _counted(self, record):
    if record.name == "uvicorn.access" and isinstance(record.args, tuple) \
            and len(record.args) >= 3:
        COUNTS[str(record.args[2]).partition("?")[0]] += 1
    return _FILTER(self, record)


def _dump(path: str) -> None:
    while True:
        time.sleep(0.5)
        with open(path + ".tmp", "w") as f:
            json.dump(dict(COUNTS), f)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    http_logging.RoutineAccessFilter.filter = _counted
    threading.Thread(target=_dump, args=(os.environ["FEDPPL_REQUEST_COUNTS"],),
                     daemon=True).start()
    sys.argv = ["flower-superlink", *sys.argv[1:]]
    flower_superlink()
