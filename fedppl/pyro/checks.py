"""Before a run: the clients' data against the Pyro model (the core's
:func:`fedppl.infer.variational.check_clients`, traced with ``pyro.poutine``), with the core's
messages.

Example::

    >>> import numpy as np, torch, pyro, pyro.distributions as dist, fedppl
    >>> from fedppl.pyro import PVIGuide
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    >>> X = np.random.default_rng(0).normal(size=(20, 2))
    >>> clients = fedppl.partition.homogeneous(X, 2.0 * (X[:, 0] > 0), num_clients=2, seed=0)
    >>> guide = PVIGuide(model, dtype=torch.float32).setup(*clients.client(0))
    >>> try:
    ...     check_clients(guide, clients, {})
    ... except ValueError as e:
    ...     print(str(e)[:56])
    client 0: observed site 'y' has values outside its distr
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from pyro.poutine.util import site_is_subsample

from fedppl.clients import Clients
from fedppl.pyro.sites import cast_floats, nodes, original, trace

__all__ = ["check_clients", "refuse_subsampling"]


def check_clients(guide: Any, clients: Clients, model_kwargs: dict) -> None:
    """Before anything runs: every client's observations lie in their likelihood's support, and
    every client's model gives each local site the prototype's shape (messages as the NumPyro
    core's)."""
    layout = guide.layout_or_raise()
    want = {} if guide.local_layout is None else {s.name: s.shape
                                                  for s in guide.local_layout.sites}
    if not want and clients.num_clients > 1 and _observations_in_support(
            guide.model, cast_floats(clients.pooled().client(0), layout.dtype), model_kwargs):
        return
    for k in range(clients.num_clients):
        who = clients.names[k]
        try:
            tr = trace(guide.model, cast_floats(clients.client(k), layout.dtype), model_kwargs)
        except Exception as err:
            raise ValueError(f"{who}: the model fails on this client's data: "
                             f"{original(err)}") from err
        for name, site in nodes(tr).items():
            if site["type"] != "sample" or not site["is_observed"] or name in layout.names:
                continue
            value = torch.as_tensor(site["value"])
            inside = torch.as_tensor(site["fn"].support.check(value))
            if not bool(inside.all()):
                bad = value[~inside] if inside.shape == value.shape else value.reshape(-1)[:5]
                raise ValueError(f"{who}: observed site '{name}' has values outside its "
                                 f"distribution's support {site['fn'].support} (e.g. "
                                 f"{np.unique(bad.numpy())[:5].tolist()})")
        for name, shape in want.items():
            if name not in nodes(tr):
                raise ValueError(f"{who}: the model has no local site '{name}' with this "
                                 "client's data")
            got = tuple(nodes(tr)[name]["value"].shape)
            if got != shape:
                raise ValueError(
                    f"local site '{name}' has shape {got} for {who} but {shape} for "
                    f"{clients.names[0]}; every client's private guide must have one shape. Give "
                    "the model the number of groups as a static keyword argument (the largest "
                    "over clients; groups without data keep their prior)")


def refuse_subsampling(model: Callable, data: tuple, model_kwargs: dict,
                       who: str = "the check") -> None:
    """A plate that subsamples gives a client's log-likelihood at a draw only as a minibatch
    estimate: ``who`` refuses it (the core's
    :func:`fedppl.infer.importance.refuse_subsampling`, traced with ``pyro.poutine``)."""
    for name, site in nodes(trace(model, data, model_kwargs)).items():
        if not site_is_subsample(site):
            continue
        size, batch = site["fn"].size, site["fn"].subsample_size
        if batch is not None and batch < size:
            raise ValueError(f"the model subsamples plate '{name}' ({batch} of {size} rows): {who} "
                             "needs each client's exact log-likelihood at every draw. Run "
                             f"{who} with the same model without subsample_size")


def _observations_in_support(model: Callable, data: tuple, model_kwargs: dict) -> bool:
    try:
        tr = trace(model, data, model_kwargs)
    except Exception:
        return False
    return all(bool(torch.as_tensor(site["fn"].support.check(site["value"])).all())
               for site in nodes(tr).values()
               if site["type"] == "sample" and site["is_observed"])
