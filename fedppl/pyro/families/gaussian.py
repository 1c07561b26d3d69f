"""The core's natural-parameter algebra (:mod:`fedppl.families.gaussian`) on torch tensors.

Each function is the core's, called on the tensors as JAX arrays (same dtype) and answering in
torch: one implementation, batched over leading axes as the core's is. What needs torch's own
randomness or indexing is here: :func:`sample` (a ``torch.Generator``), :func:`index`. Not
differentiable by torch (the port's local steps run in the core).

Example::

    >>> import torch
    >>> from fedppl.pyro.families.gaussian import product, to_moments
    >>> eye = torch.eye(2, dtype=torch.float32)
    >>> prior = FullGaussian.from_moments(torch.zeros(2, dtype=torch.float32), eye)
    >>> mean, cov = to_moments(product(prior, FullGaussian(eye[0], eye)))
    >>> mean.dtype, [round(x, 5) for x in mean.tolist() + torch.diagonal(cov).tolist()]
    (torch.float32, [0.5, 0.0, 0.5, 0.5])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedppl.families import gaussian as core
from fedppl.pyro.bridge import CORE_TYPES, to_jax, to_torch

__all__ = ["DiagGaussian", "FullGaussian", "Gaussian", "Conditional", "index", "sample",
           "to_torch"]  # and every other function of fedppl.families.gaussian, on torch tensors


def as_torch(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return to_torch(fn(*to_jax(args), **to_jax(kwargs)))

    return wrapped


class DiagGaussian(core.DiagGaussian):
    """The core's :class:`~fedppl.families.gaussian.DiagGaussian`, built from torch moments."""

    __slots__ = ()

    @classmethod
    def from_moments(cls, mean: Tensor, var: Tensor) -> DiagGaussian:  # type: ignore[override]
        return cls(*as_torch(core.DiagGaussian.from_moments)(mean, var))


class FullGaussian(core.FullGaussian):
    """The core's :class:`~fedppl.families.gaussian.FullGaussian`, built from torch moments."""

    __slots__ = ()

    @classmethod
    def from_moments(cls, mean: Tensor, cov: Tensor) -> FullGaussian:  # type: ignore[override]
        return cls(*as_torch(core.FullGaussian.from_moments)(mean, cov))


Gaussian = core.Gaussian
Conditional = core.Conditional
CORE_TYPES.update({DiagGaussian: core.DiagGaussian, FullGaussian: core.FullGaussian})


def __getattr__(name: str) -> Callable:
    """``product``, ``kl``, ``to_moments``...: the core's function of that name, on torch."""
    if name.startswith("_") or not callable(getattr(core, name, None)):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return as_torch(getattr(core, name))


def index(g: Any, idx: Any) -> Any:
    """Entry ``idx`` of the leading axis of every tensor of ``g`` (a Gaussian or Conditional)."""
    return type(g)(*(x[idx] for x in g))


def sample(generator: torch.Generator | None, g: Any, num_samples: int) -> Tensor:
    """``num_samples`` draws ``(num_samples, D)`` of an unbatched Gaussian, from ``generator``."""
    mean, sc = __getattr__("mean_and_scale_tril")(g)
    eps = torch.randn((num_samples, g.dim), generator=generator, dtype=mean.dtype)
    return mean + (eps * sc if isinstance(g, core.DiagGaussian) else eps @ sc.T)
