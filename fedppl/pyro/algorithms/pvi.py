"""The core's PVI server, acceptance rule and acknowledgement (:mod:`fedppl.algorithms.pvi`) on
torch tensors: the same functions, called on the tensors as JAX arrays, answering in torch (what
a Pyro run uses is the core's own, inside its compiled rounds).

Example::

    >>> import torch
    >>> from fedppl.pyro.families import gaussian as g
    >>> q = g.FullGaussian(torch.zeros(2), torch.eye(2))
    >>> deltas = g.FullGaussian(torch.zeros(2, 2), torch.stack([0.1 * torch.eye(2),
    ...                                                         -5 * torch.eye(2)]))
    >>> verdicts(q, deltas).tolist()                       # fine; q would be improper
    [1.0, -2.0]
"""

from __future__ import annotations

from fedppl.algorithms import pvi as core
from fedppl.algorithms.pvi import (
    IMPLAUSIBLE,
    MAX_DIVERGENCE,
    NOT_FINITE,
    NOT_PD,
    NOT_RECEIVED,
    REFUSALS,
    STEP_SIZES,
    ClientMessage,
    ClientState,
    ServerState,
)
from fedppl.pyro.families.gaussian import as_torch

__all__ = ["ServerState", "ClientState", "ClientMessage", "init", "verdicts", "server_update",
           "acknowledge", "REFUSALS", "STEP_SIZES", "MAX_DIVERGENCE", "NOT_FINITE", "NOT_PD",
           "IMPLAUSIBLE", "NOT_RECEIVED"]

init = as_torch(core.init)
verdicts = as_torch(core.verdicts)
server_update = as_torch(core.server_update)
acknowledge = as_torch(core.acknowledge)
