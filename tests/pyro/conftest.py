"""The Pyro port's tests: torch in float64 on one thread (as OpenBLAS is for the rest: small
dense solves slow down badly with threads fighting over two busy cores)."""

from __future__ import annotations

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)


def key(seed: int = 0):
    """A torch generator (the Pyro port's ``rng_key``)."""
    return torch.Generator().manual_seed(seed)


def moments(result) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-site unconstrained ``(mean, sd)`` of a Pyro-port result's q (the twin of
    ``tests.reference.unconstrained_moments``)."""
    mean, cov = result.mean_and_cov()
    var = cov if cov.ndim == 1 else torch.diagonal(cov)
    return {s.name: (mean[s.slice].numpy(), var[s.slice].sqrt().numpy())
            for s in result.guide.layout.sites}
