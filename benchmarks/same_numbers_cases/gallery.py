"""PVI on every model of the gallery (``examples/gallery``: its data generator at seed 0, the
entry's family and global sites, sequential, 5 rounds): :func:`numbers` gives q and the history
of each."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HISTORY = ("elbo", "free_energy", "kl_change", "bytes_up", "bytes_down", "messages_up")
ROUNDS = 5


def numbers() -> dict:
    import jax

    import fedppl
    from fedppl.guides import PVIGuide

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.append(root)
    from examples.gallery import GALLERY

    out = {}
    for name, entry in GALLERY.items():
        arrays, kwargs = entry.make_data(0)
        clients = fedppl.Clients.from_list(arrays)
        guide = PVIGuide(entry.model, global_sites=entry.global_sites, family=entry.family)
        r = fedppl.PVI(entry.model, guide, schedule="sequential", damping=1.0).run(
            jax.random.key(0), clients, num_rounds=ROUNDS, progress_bar=False, **kwargs)
        out[name] = {"q": [np.asarray(x) for x in (r.q.nat1, r.q.prec)],
                     **{h: np.asarray(r.history[h], float) for h in HISTORY
                        if h in r.history}}
    return out
