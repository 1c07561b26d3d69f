"""A client's log-likelihood as a function of the flat unconstrained vector: evaluated by torch on
the Pyro model, handed to the core as a JAX function.

:class:`LogLik` runs the Pyro model under the :mod:`~fedppl.pyro.handlers.client` messenger with
the global (and local) sites set to given values, and sums the observed sites' masked, scaled log
densities (the twin of :func:`fedppl.algorithms.natural_gradient.log_lik_fn`). :func:`log_lik_fn`
wraps it for the core (:func:`fedppl.pyro.bridge.differentiable`): the core's solvers then take
its value, gradient and Hessian (torch's) at the draws of every client in one callback.

Example::

    >>> import jax, jax.numpy as jnp, torch, pyro, pyro.distributions as dist
    >>> from fedppl.pyro.guides import PVIGuide
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> X, y = jnp.ones((4, 2)), jnp.zeros(4)
    >>> guide = PVIGuide(model, dtype=torch.float32).setup(X, y)
    >>> log_lik = log_lik_fn(model, guide, (X, y), jnp.array([True, True, False, False]))
    >>> jax.grad(log_lik)(jnp.ones(2)).tolist()            # two rows of -(x.w - y) x
    [-4.0, -4.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import Tensor

from fedppl.pyro.bridge import differentiable, host, jax_dtype
from fedppl.pyro.handlers.client import client
from fedppl.pyro.handlers.polya_gamma import unwrap
from fedppl.pyro.handlers.substitute import substitute
from fedppl.pyro.sites import SiteLayout, nodes

__all__ = ["LogLik", "log_lik_fn", "observed_log_density", "model_terms"]


class _Bernoulli(dist.Bernoulli):
    """``Bernoulli`` whose log density is ``-y softplus(-f) - (1 - y) softplus(f)``: the same
    numbers as torch's ``binary_cross_entropy_with_logits`` (to round-off), which under
    ``torch.func.vmap`` runs far slower on CPU."""

    def log_prob(self, value):
        f = self.logits
        softplus = torch.nn.functional.softplus
        return -(value * softplus(-f) + (1 - value) * softplus(f))


class _FastLikelihoods(Messenger):
    """Observed ``Bernoulli`` sites through :class:`_Bernoulli` (inside fedppl's evaluations of a
    model only; the model and its distributions are untouched)."""

    def _pyro_sample(self, msg) -> None:
        if not msg["is_observed"]:
            return
        wrappers, base = unwrap(msg["fn"])
        if isinstance(base, torch.distributions.Bernoulli) and not isinstance(base, _Bernoulli):
            new: torch.distributions.Distribution = _Bernoulli(logits=base.logits,
                                                               validate_args=False)
            for w in reversed(wrappers):
                new = w(new)
            msg["fn"] = new


def observed_log_density(tr: poutine.Trace, dtype: torch.dtype) -> Tensor:
    """The trace's observed sites' log density (masks and scales applied), in ``dtype``."""
    total = torch.zeros((), dtype=dtype)
    for site in nodes(tr).values():
        if site["type"] == "sample" and site["is_observed"] and not site_is_subsample(site):
            lp = scale_and_mask(site["fn"].log_prob(site["value"]), site["scale"], site["mask"])
            total = total + lp.sum()
    return total.to(dtype)


class LogLik:
    """``log p(y_k, z_k | theta)`` of one client at one point ``phi = (theta, z_k)``, in torch.

    A local coordinate that none of the client's observations depends on (a group it holds no
    data for) is marginalised out exactly, as in the NumPyro core: its prior term is replaced by
    a standard normal in its own coordinate.
    """

    def __init__(self, model: Callable, layout: SiteLayout, local: SiteLayout | None):
        self.model, self.layout, self.loc = model, layout, local
        self.dtype = layout.dtype

    def _trace(self, phi: Tensor, seed: Tensor, mask: Tensor, data: tuple):
        D = self.layout.dim
        values = self.layout.constrain(phi[:D])
        if self.loc is not None:
            values.update(self.loc.constrain(phi[D:]))
        fn = substitute(client(self.model, mask=mask, draw=seed), data=values)
        return poutine.trace(_FastLikelihoods()(fn)).get_trace(*data)

    def observed(self, phi: Tensor, seed: Tensor, mask: Tensor, *data: Tensor) -> Tensor:
        return observed_log_density(self._trace(phi, seed, mask, data), self.dtype)

    def touched(self, mask: Tensor, *data: Tensor) -> Tensor:
        """Which local coordinates the client's data touch (the observed term's gradient at two
        points)."""
        D, d = self.layout.dim, self.loc.dim if self.loc is not None else 0
        grad = torch.func.grad(self.observed)
        seed = torch.zeros((), dtype=torch.long)
        probe = [torch.cat([torch.full((D,), c, dtype=self.dtype),
                            c + 0.05 * torch.arange(d, dtype=self.dtype)]) for c in (0.1, -0.3)]
        return sum(grad(p, seed, mask, *data)[D:].abs() for p in probe) > 0

    def __call__(self, phi: Tensor, seed: Tensor, touched: Tensor, mask: Tensor,
                 *data: Tensor) -> Tensor:
        tr = self._trace(phi, seed, mask, data)
        total = observed_log_density(tr, self.dtype)
        if self.loc is None:
            return total
        z = phi[self.layout.dim:]
        for s in self.loc.sites:
            u = z[s.slice]
            here = touched[s.slice]
            std = -0.5 * (u**2 + math.log(2 * math.pi))
            value = nodes(tr)[s.name]["value"]
            lp = nodes(tr)[s.name]["fn"].log_prob(value)
            ladj = s.transform.log_abs_det_jacobian(u.reshape(s.unconstrained_shape), value)
            if tuple(lp.shape) == s.shape and tuple(ladj.shape) == s.shape and \
                    s.size == lp.numel():
                exact = (lp + ladj).reshape(-1)
                total = total + torch.where(here, exact, std).sum()
            else:  # terms that do not split by coordinate: the whole site or nothing
                total = total + torch.where(here.any(), lp.sum() + ladj.sum(), std.sum())
        return total.to(self.dtype)


def cast(data: tuple, dtype) -> tuple:
    """The floating arrays of ``data`` in ``dtype`` (JAX), the others as they are."""
    return tuple(jnp.asarray(a, dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating)
                 else jnp.asarray(a) for a in data)


def log_lik_fn(model: Callable, guide, data: tuple, mask) -> Callable:
    """``(phi, seed=0) -> log p(y_k, z_k | theta)`` as a JAX function (the core's
    :func:`~fedppl.algorithms.natural_gradient.log_lik_fn` for a Pyro guide): torch evaluates
    it, its gradient and its Hessian."""
    layout = guide.layout_or_raise()
    lik = LogLik(model, layout, guide.local_layout)
    dtype = jax_dtype(layout.dtype)
    data, mask = cast(data, dtype), jnp.asarray(mask)
    touched = jnp.zeros(0, bool)
    if guide.local_layout is not None:
        touched = host(lik.touched, jax.ShapeDtypeStruct((guide.local_layout.dim,), bool), mask,
                       data)
    value = differentiable(lik)

    def log_lik(phi, seed=0):
        return value(jnp.asarray(phi, dtype), jnp.asarray(seed, jnp.int32), touched, mask,
                     *data)

    return log_lik


def model_terms(read: Callable, model: Callable, guide, data: tuple, mask) -> tuple:
    """``read(model scoped to the client, layout, *data)``, the terms of the client's likelihood
    that torch reads from the Pyro model (a tuple of tensors), as JAX arrays."""
    layout = guide.layout_or_raise()

    def call(mask_k, *data_k):
        return tuple(read(client(model, mask=mask_k), layout, *data_k))

    return host(call, None, jnp.asarray(mask), cast(data, jax_dtype(layout.dtype)))
