"""``client``: scope a Pyro model to one client's padded, masked data.

The messenger twin of :class:`fedppl.handlers.client`: it masks the padded rows out of every
observed site inside the data plate (on the message's ``mask``, as ``poutine.mask`` does), and
with ``num_data`` rescales the likelihood by ``num_data / mask.sum()`` (a minibatch of the
client's points). A data plate that subsamples (``pyro.plate("data", N, subsample_size=b)``) gets
the mask rows of its subsample (Pyro scales the batch by ``N / b``); given ``draw`` (the index of
one of a local step's Monte Carlo draws) the messenger picks that minibatch itself, consecutive
slices of one fixed permutation. A ``pyro.factor`` in no plate is a term of the prior, which the
server counts once, so clients drop it. A site observed through ``poutine.condition`` is masked
like one with ``obs=``, in either nesting.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro import poutine
    >>> from fedppl.pyro.handlers import substitute
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    >>> y = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0])
    >>> mask = torch.tensor([True, True, True, False, False])
    >>> w = {"w": torch.tensor([0.5, 0.5])}                # global values, kept latent
    >>> padded = poutine.trace(substitute(client(model, mask=mask), w)).get_trace(X, y)
    >>> real = poutine.trace(substitute(model, w)).get_trace(X[:3], y[:3])
    >>> bool(torch.isclose(padded.log_prob_sum(), real.log_prob_sum()))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from fedppl.pyro.handlers._observed import observation
from fedppl.pyro.sites import is_prior_factor

__all__ = ["client", "ClientMessenger"]


class ClientMessenger(Messenger):
    """Mask padded rows (and optionally rescale) at the observed sites of the data plate.

    :param mask: boolean tensor ``(N_max,)``, True at the client's real data points.
    :param plate: name of the plate over data points; by default the plate whose (full) size is
        ``N_max``. Every observed site must sit inside it.
    :param num_data: if given, the likelihood is scaled by ``num_data / mask.sum()``.
    :param draw: the Monte Carlo draw this call belongs to; a subsampling data plate then takes
        the draw's slice of a fixed permutation instead of a random minibatch.
    """

    def __init__(self, mask: Tensor | None = None, plate: str | None = None,
                 num_data: int | Tensor | None = None, draw: int | Tensor | None = None):
        if mask is None:
            raise ValueError("client needs a mask over the padded data points")
        mask = torch.as_tensor(mask)
        if mask.ndim != 1:
            raise ValueError(f"mask must be one-dimensional, got shape {tuple(mask.shape)}")
        super().__init__()
        self.mask = mask.bool()
        self.plate = plate
        self.num_data = num_data
        self.draw = draw
        self._subsamples: dict = {}

    def __enter__(self):
        self._subsamples = {}
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        self._subsamples = {}
        return super().__exit__(*args)

    def _is_data_plate(self, name: str, size: int) -> bool:
        return name == self.plate if self.plate is not None else size == self.mask.shape[0]

    def _pyro_sample(self, msg) -> None:
        if site_is_subsample(msg):
            size, batch = msg["fn"].size, msg["fn"].subsample_size
            if (self.draw is not None and msg["value"] is None and batch is not None
                    and batch < size and self._is_data_plate(msg["name"], size)):
                # draw s's minibatch: rows s b, ..., s b + b - 1 (mod N) of a fixed permutation
                perm = torch.randperm(size, generator=torch.Generator().manual_seed(0))
                start = (torch.as_tensor(self.draw) * batch) % size
                msg["value"] = perm[(start + torch.arange(batch)) % size]
            return
        if msg["type"] != "sample" or not observation(self, msg)[0]:
            return
        if is_prior_factor(msg):  # a term of the prior: the server counts it once
            msg["mask"] = False if msg["mask"] is None else msg["mask"] & False
            return
        n = self.mask.shape[0]
        frame = next((f for f in msg["cond_indep_stack"]
                      if f.name in self._subsamples or self._is_data_plate(
                          f.name, f.full_size if f.full_size is not None else f.size)), None)
        if frame is None:
            which = f"named '{self.plate}'" if self.plate else f"of size {n}"
            raise ValueError(
                f"observed site '{msg['name']}' is not inside a plate {which}; put per-datum "
                "observations inside `with pyro.plate('data', X.shape[0]):` (or name the data "
                "plate with plate=...)")
        mask = self.mask
        if frame.name in self._subsamples:
            mask = mask[self._subsamples[frame.name]]
        elif frame.size != n:
            raise ValueError(
                f"the data plate '{frame.name}' has size {frame.size} but the mask has {n} rows")
        m = mask.reshape((mask.shape[0],) + (1,) * (-frame.dim - 1))
        msg["mask"] = m if msg["mask"] is None else msg["mask"] & m
        if self.num_data is not None:
            factor = torch.as_tensor(self.num_data) / torch.clamp(self.mask.sum(), min=1)
            msg["scale"] = factor * msg["scale"]

    def _pyro_post_sample(self, msg) -> None:
        if site_is_subsample(msg) and self._is_data_plate(msg["name"], msg["fn"].size):
            self._subsamples[msg["name"]] = msg["value"]


def client(fn: Callable | None = None, mask: Tensor | None = None, plate: str | None = None,
           num_data: int | Tensor | None = None, draw: int | Tensor | None = None):
    """The :class:`ClientMessenger` around ``fn`` (or the messenger itself, for ``with``)."""
    msngr = ClientMessenger(mask, plate, num_data, draw)
    return msngr(fn) if fn is not None else msngr
