"""Closed-form PVI local updates for Bernoulli-logit Pyro models by Polya-Gamma CAVI.

The core's :class:`fedppl.algorithms.polya_gamma.PolyaGammaSolver` on a Pyro model: each client
runs the core's CAVI sweeps (:func:`fedppl.guides.cavi.iterate`) with its cavity as the prior on
the logit map that torch reads from the model (:func:`fedppl.pyro.guides.cavi.logit_terms`);
the PVI fixed point is the global CAVI (Jaakkola-Jordan) posterior of the pooled data.
:func:`validate` checks the model and every client's labels before a run.

Example::

    >>> import torch, numpy as np, fedppl, pyro, pyro.distributions as dist
    >>> from fedppl.pyro.guides import PVIGuide
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    >>> X = np.random.default_rng(0).normal(size=(30, 2))
    >>> clients = fedppl.partition.homogeneous(X, 2 * (X[:, 0] > 0) - 1.0, num_clients=2, seed=0)
    >>> try:
    ...     validate(model, PVIGuide(model), clients)
    ... except ValueError as e:
    ...     print(str(e).split(":")[0])
    client 0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from fedppl.algorithms.natural_gradient import LocalResult
from fedppl.clients import Clients
from fedppl.guides import cavi as core
from fedppl.pyro.algorithms.terms import model_terms
from fedppl.pyro.guides import cavi
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.client import client
from fedppl.pyro.sites import cast_floats, original

__all__ = ["PolyaGammaSolver", "validate"]


class PolyaGammaSolver(NamedTuple):
    """A client's local free energy maximised by the core's Polya-Gamma CAVI sweeps, on the
    logit map torch reads from the Pyro model."""

    model: Callable
    guide: PVIGuide
    max_iters: int = 200
    tol: float = 1e-10

    def __call__(self, q_cavity, q, data, mask, rng_key):
        lik = core.LogitLikelihood(*model_terms(cavi.logit_terms, self.model, self.guide, data,
                                                mask))
        q_new, sweeps = core.iterate(q_cavity, lik, q, self.max_iters, self.tol)
        return LocalResult(q_new, core.elbo(q_new, q_cavity, lik), sweeps < self.max_iters,
                           sweeps)


def validate(model: Callable, guide: PVIGuide, clients: Clients) -> None:
    """Raise ``ValueError`` naming the client if the model is not Bernoulli-logit and affine in
    the global sites (checked on the first client), or a client's labels are outside {0, 1} or
    its logits are not finite."""
    layout = guide.setup(*clients.client(0)).layout_or_raise()
    theta = torch.zeros(layout.dim, dtype=layout.dtype)
    for k, name in enumerate(clients.names):
        arrays = cast_floats(clients.client(k), layout.dtype)
        scoped = client(model, mask=torch.ones(len(arrays[0]), dtype=torch.bool))
        try:
            reason = cavi.check(scoped, layout, *arrays) if k == 0 else None
            if reason is not None:
                raise ValueError(f"the Polya-Gamma solver needs Bernoulli logits affine in the "
                                 f"global sites: {reason}")
            values = cavi.logit_values(scoped, layout, theta, arrays, {})
        except ValueError as e:
            raise ValueError(f"{name}: {original(e)}") from e
        logits, kappa, weight = (a.numpy() for a in values)
        keep = weight > 0
        labels = kappa[keep] + 0.5
        bad = ~((labels == 0.0) | (labels == 1.0))
        if bad.any():
            raise ValueError(f"{name}: labels {np.unique(labels[bad])[:5].tolist()} of an "
                             "observed Bernoulli site are outside {0, 1}")
        if not np.all(np.isfinite(logits[keep])):
            raise ValueError(f"{name}: non-finite logits at an observed Bernoulli site")
