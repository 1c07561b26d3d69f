"""``tempered``: scale the KL term of chosen latent sites by ``alpha``.

The messenger twin of :class:`fedppl.handlers.tempered`: wrap both the model and the guide, and
each named latent site contributes ``alpha * (log p - log q)`` to the ELBO (the HVM's
alpha-scaled KL). Observed sites, and named sites observed through ``poutine.condition`` in either
nesting, are untouched. The guide must sample each named site directly.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro import poutine
    >>> def model(y):
    ...     Z = pyro.sample("Z", dist.Normal(0.0, 1.0))
    ...     pyro.sample("y", dist.Normal(Z, 1.0), obs=y)
    >>> tr = poutine.trace(tempered(model, alpha=0.1, sites=["Z"])).get_trace(torch.tensor(1.0))
    >>> tr.nodes["Z"]["scale"], tr.nodes["y"]["scale"]       # the observed site is untouched
    (0.1, 1.0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pyro.poutine.messenger import Messenger

from fedppl.pyro.handlers._observed import observation

__all__ = ["tempered", "TemperedMessenger"]


class TemperedMessenger(Messenger):
    """Multiply the log density of the named latent sample sites by ``alpha``.

    :param alpha: the scale, ``alpha >= 0``.
    :param sites: names of latent sites to scale.
    """

    def __init__(self, alpha: float = 1.0, sites: Iterable[str] = ()):
        if not (alpha >= 0):
            raise ValueError(f"alpha must be non-negative, got {alpha}")
        self.sites = frozenset(sites)
        if not self.sites:
            raise ValueError("tempered needs at least one site name")
        super().__init__()
        self.alpha = alpha

    def _pyro_sample(self, msg) -> None:
        if msg["name"] in self.sites and not observation(self, msg)[0]:
            msg["scale"] = self.alpha * msg["scale"]


def tempered(fn: Callable | None = None, alpha: float = 1.0, sites: Iterable[str] = ()):
    """The :class:`TemperedMessenger` around ``fn`` (or the messenger itself, for ``with``)."""
    msngr = TemperedMessenger(alpha, sites)
    return msngr(fn) if fn is not None else msngr
