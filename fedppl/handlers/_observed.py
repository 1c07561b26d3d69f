"""Whether a sample site ends up observed, asked from inside an enclosing ``condition``.

NumPyro runs ``process_message`` innermost handler first, so in ``condition(h(model), data)`` the
handler ``h`` meets a site of ``data`` while it still looks latent: ``condition`` observes it only
afterwards. fedppl's handlers that act on observed (or on latent) sites ask :func:`observation`
instead of reading ``msg["is_observed"]``, so that both nestings mean the same thing. It applies
the enclosing ``condition`` handlers to a copy of the message (they only set ``value`` and
``is_observed``) and stops at an enclosing ``block`` that hides the site, which ``condition`` would
then never see.

Example::

    >>> import numpyro, numpyro.distributions as dist
    >>> from numpyro.handlers import condition, seed, trace
    >>> from numpyro.primitives import Messenger
    >>> class probe(Messenger):                         # records what a handler would see
    ...     def process_message(self, msg):
    ...         if msg["type"] == "sample":
    ...             self.seen = observation(self, msg)  # in a Messenger's process_message
    >>> def model():
    ...     numpyro.sample("x", dist.Normal(0.0, 1.0))
    >>> p = probe(model)
    >>> _ = trace(seed(condition(p, {"x": 2.0}), 0)).get_trace()  # `condition` is outside `p`
    >>> is_observed, value = p.seen
    >>> is_observed, float(value)
    (True, 2.0)
    >>> _ = trace(seed(p, 0)).get_trace()                          # no `condition`: latent
    >>> p.seen
    (False, None)
"""

from __future__ import annotations

from typing import Any

import numpyro.primitives
from numpyro import handlers

__all__ = ["observation"]


def observation(handler: Any, msg: dict) -> tuple[bool, Any]:
    """``(is_observed, value)`` of the sample ``msg`` once the ``condition`` handlers enclosing
    ``handler`` on NumPyro's stack have processed it (``value`` is None for a latent site)."""
    if msg["type"] != "sample" or msg["is_observed"]:
        return msg["is_observed"], msg["value"]
    stack = numpyro.primitives._PYRO_STACK  # outermost first; `handler` is on it while it runs
    inner = next((i for i, h in enumerate(stack) if h is handler), 0)
    probe = {**msg, "kwargs": {**msg["kwargs"]}}
    for h in reversed(stack[:inner]):
        if isinstance(h, handlers.block) and h.hide_fn(probe):
            break
        if isinstance(h, handlers.condition):
            h.process_message(probe)
    return probe["is_observed"], (probe["value"] if probe["is_observed"] else None)
