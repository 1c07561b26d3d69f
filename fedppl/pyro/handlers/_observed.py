"""Whether a sample site ends up observed, asked from inside an enclosing ``poutine.condition``.

Pyro runs the messengers innermost first, so in ``condition(h(model), data)`` the messenger ``h``
meets a site of ``data`` while it still looks latent. fedppl's messengers ask
:func:`observation` instead of reading ``msg["is_observed"]``: it applies the enclosing
``condition`` messengers to a copy of the message and stops at an enclosing ``block`` that hides
the site (which ``condition`` would then never see).

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro import poutine
    >>> from pyro.poutine.messenger import Messenger
    >>> class probe(Messenger):
    ...     def _pyro_sample(self, msg):
    ...         self.seen = observation(self, msg)
    >>> def model():
    ...     pyro.sample("x", dist.Normal(0.0, 1.0))
    >>> p = probe()
    >>> _ = poutine.trace(poutine.condition(p(model), {"x": torch.tensor(2.0)})).get_trace()
    >>> p.seen[0], float(p.seen[1])
    (True, 2.0)
"""

from __future__ import annotations

from typing import Any

from pyro.poutine.block_messenger import BlockMessenger
from pyro.poutine.condition_messenger import ConditionMessenger
from pyro.poutine.runtime import _PYRO_STACK

__all__ = ["observation"]


def observation(handler: Any, msg: dict) -> tuple[bool, Any]:
    """``(is_observed, value)`` of the sample ``msg`` once the ``condition`` messengers enclosing
    ``handler`` have processed it (``value`` is None for a latent site)."""
    if msg["type"] != "sample" or msg["is_observed"]:
        return bool(msg["is_observed"]), msg["value"]
    stack = list(_PYRO_STACK)  # outermost first; `handler` is on it while it runs
    inner = next((i for i, h in enumerate(stack) if h is handler), 0)
    probe: Any = {**msg, "kwargs": {**msg["kwargs"]}}
    for h in reversed(stack[:inner]):
        if isinstance(h, BlockMessenger) and h.hide_fn(probe):
            break
        if isinstance(h, ConditionMessenger):
            h._pyro_sample(probe)
    return bool(probe["is_observed"]), (probe["value"] if probe["is_observed"] else None)
