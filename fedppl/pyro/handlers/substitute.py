"""``substitute``: give latent sample sites fixed values without making them observed.

NumPyro's ``substitute`` does this for sample sites; Pyro's ``poutine.substitute`` acts on
``pyro.param`` sites only, and ``poutine.condition`` turns the sites into observations (which the
``client`` messenger would then mask as data). fedppl evaluates a model at given global and local
values through this messenger.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro import poutine
    >>> def model():
    ...     return pyro.sample("x", dist.Normal(0.0, 1.0))
    >>> tr = poutine.trace(substitute(model, {"x": torch.tensor(2.0)})).get_trace()
    >>> float(tr.nodes["x"]["value"]), tr.nodes["x"]["is_observed"]
    (2.0, False)
"""

from __future__ import annotations

from collections.abc import Callable

from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

__all__ = ["substitute", "SubstituteMessenger"]


class SubstituteMessenger(Messenger):
    """Set the latent sample sites named in ``data`` to those values (still latent).

    :param data: ``{site name: value}``.
    """

    def __init__(self, data: dict):
        super().__init__()
        self.data = data

    def _pyro_sample(self, msg) -> None:
        if msg["name"] in self.data and not msg["is_observed"] and not site_is_subsample(msg):
            msg["value"] = self.data[msg["name"]]
            msg["done"] = True


def substitute(fn: Callable | None = None, data: dict | None = None):
    """The :class:`SubstituteMessenger` around ``fn`` (or the messenger itself, for ``with``)."""
    msngr = SubstituteMessenger(data or {})
    return msngr(fn) if fn is not None else msngr
