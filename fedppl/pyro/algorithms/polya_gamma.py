"""Closed-form PVI local updates for Bernoulli-logit Pyro models by Polya-Gamma CAVI.

The twin of :mod:`fedppl.algorithms.polya_gamma`: each client runs CAVI with its cavity as the
prior, warm-started at the current ``q``, until ``c`` stops moving or ``max_iters`` sweeps; the
PVI fixed point is the global CAVI (Jaakkola-Jordan) posterior of the pooled data. The clients'
logit maps do not depend on ``q``: :meth:`PolyaGammaSolver.prepare` reads them once per run, for
all clients in one ``torch.func.vmap``.

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
from typing import Any, NamedTuple

import numpy as np
import torch

from fedppl.clients import Clients
from fedppl.pyro.algorithms.natural_gradient import LocalResult
from fedppl.pyro.families import gaussian as g
from fedppl.pyro.guides import cavi
from fedppl.pyro.guides.pvi_guide import PVIGuide
from fedppl.pyro.handlers.client import client
from fedppl.pyro.sites import cast_floats, original, vmap

__all__ = ["PolyaGammaSolver", "validate", "padded"]


def padded(clients: Clients, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The clients' arrays padded with zeros to ``N_max`` rows and stacked, floats in ``dtype``,
    and the ``(K, N_max)`` mask (from the arrays NumPy holds: no JAX)."""
    n = clients.max_size
    out = []
    for i in range(len(clients.data[0])):
        parts = []
        for d in clients.data:
            a = np.asarray(d[i])
            parts.append(np.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1)))
        out.append(np.stack(parts))
    mask = torch.as_tensor(np.arange(n)[None, :] < clients.sizes[:, None])
    return cast_floats(out, dtype), mask


class PolyaGammaSolver(NamedTuple):
    """Clients' local free energies maximised by Polya-Gamma CAVI (batched over clients)."""

    model: Callable
    guide: PVIGuide
    max_iters: int = 200
    tol: float = 1e-10

    def prepare(self, data: tuple, masks: torch.Tensor) -> cavi.LogitLikelihood:
        layout = self.guide._require_setup()
        data = cast_floats(data, layout.dtype)

        def terms(data_k, mask_k):
            return tuple(cavi.logit_terms(client(self.model, mask=mask_k), layout, *data_k))

        return cavi.LogitLikelihood(*vmap(terms, (0, 0))(data, masks))

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, ctx: cavi.LogitLikelihood,
                 local: Any = None, generator: Any = None) -> LocalResult:
        q_new, sweeps = cavi.iterate(q_cavity, ctx, q, self.max_iters, self.tol)
        return LocalResult(q_new, cavi.elbo(q_new, q_cavity, ctx), sweeps < self.max_iters,
                           sweeps)


def validate(model: Callable, guide: PVIGuide, clients: Clients) -> None:
    """Raise ``ValueError`` naming the client if the model is not Bernoulli-logit and affine in
    the global sites (checked on the first client), or a client's labels are outside {0, 1} or
    its logits are not finite."""
    guide.setup(*clients.client(0))
    layout, name0 = guide._require_setup(), clients.names[0]
    arrays = cast_floats(clients.client(0), layout.dtype)
    try:
        reason = cavi.check(client(model, mask=torch.ones(len(arrays[0]), dtype=torch.bool)),
                            layout, *arrays)
    except ValueError as e:
        raise ValueError(f"{name0}: {original(e)}") from e
    if reason is not None:
        raise ValueError(f"{name0}: the Polya-Gamma solver needs Bernoulli logits affine in the "
                         f"global sites: {reason}")
    data, masks = padded(clients, layout.dtype)

    def values(data_k, mask_k):
        return cavi.logit_values(client(model, mask=mask_k), layout,
                                 torch.zeros(layout.dim, dtype=layout.dtype), data_k, {})

    logits, kappa, weight = (a.numpy() for a in vmap(values, (0, 0))(data, masks))
    for k, name in enumerate(clients.names):
        keep = weight[k] > 0
        labels = kappa[k][keep] + 0.5
        bad = ~((labels == 0.0) | (labels == 1.0))
        if bad.any():
            raise ValueError(f"{name}: labels {np.unique(labels[bad])[:5].tolist()} of an "
                             "observed Bernoulli site are outside {0, 1}")
        if not np.all(np.isfinite(logits[k][keep])):
            raise ValueError(f"{name}: non-finite logits at an observed Bernoulli site")
