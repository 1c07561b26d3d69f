"""``polya_gamma``: make Bernoulli-logit observations conditionally Gaussian in their logits.

The messenger twin of :class:`fedppl.handlers.polya_gamma`. Given ``E[omega]`` per observation
(``q(omega) = PG(1, c)``; default the prior mean 1/4, Bohning's bound) it replaces an observed
Bernoulli site's log density by ``E_q(omega)[log p(y | f, omega)] = -log 2 + (y - 1/2) f -
E[omega] f^2 / 2``, a Gaussian site in the logit ``f``, and records ``msg["infer"]["polya_gamma"]
= {"logits", "kappa", "omega"}``. Sites observed through ``poutine.condition`` count in either
nesting. Labels outside {0, 1} and non-finite logits at unmasked rows raise a ``ValueError``
naming the site (when the values can be inspected: not inside a ``torch.func`` transform).

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro import poutine
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
    >>> X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    >>> y = torch.tensor([1.0, 0.0, 1.0])
    >>> w = {"w": torch.tensor([0.5, -1.0])}
    >>> tr = poutine.trace(polya_gamma(poutine.condition(model, w), omega=0.2)).get_trace(X, y)
    >>> f = tr.nodes["y"]["infer"]["polya_gamma"]["logits"]
    >>> bound = -torch.log(torch.tensor(2.0)) + (y - 0.5) * f - 0.2 * f**2 / 2
    >>> bool(torch.allclose(tr.nodes["y"]["fn"].log_prob(y), bound))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistribution
from pyro.poutine.messenger import Messenger
from torch import Tensor
from torch.distributions import constraints

from fedppl.pyro.handlers._observed import observation

__all__ = ["polya_gamma", "PolyaGammaMessenger", "PolyaGammaBernoulli"]


class PolyaGammaBernoulli(TorchDistribution):
    """The augmented Bernoulli term ``-log 2 + (y - 1/2) f - omega f^2 / 2`` (not normalised in
    ``y``); ``sample`` draws from ``Bernoulli(logits=f)``."""

    arg_constraints = {"logits": constraints.real,  # noqa: RUF012
                       "omega": constraints.positive}
    support = constraints.boolean

    def __init__(self, logits: Tensor, omega: Tensor, validate_args: bool | None = None):
        self.logits, self.omega = torch.broadcast_tensors(logits, omega)
        super().__init__(self.logits.shape, validate_args=False)

    def expand(self, batch_shape, _instance=None):
        shape = torch.Size(batch_shape)
        return PolyaGammaBernoulli(self.logits.expand(shape), self.omega.expand(shape))

    def sample(self, sample_shape=()):
        return dist.Bernoulli(logits=self.logits).sample(sample_shape)

    def log_prob(self, value):
        f = self.logits
        return -math.log(2.0) + (value - 0.5) * f - 0.5 * self.omega * f**2


class PolyaGammaMessenger(Messenger):
    """Rewrite observed Bernoulli sites into their Polya-Gamma augmented form (module doc).

    :param omega: ``E[omega]`` per observation, broadcastable to the site's value, or ``{site
        name: tensor}``; ``None`` uses 1/4.
    :param sites: names of the observed Bernoulli sites to rewrite (default: every one); a named
        site that is not an observed Bernoulli raises ``ValueError``.
    """

    def __init__(self, omega: Tensor | float | Mapping[str, Tensor] | None = None,
                 sites: Iterable[str] | None = None):
        self.sites = None if sites is None else frozenset(sites)
        if self.sites is not None and not self.sites:
            raise ValueError("polya_gamma: sites is empty; pass None to rewrite every Bernoulli")
        if isinstance(omega, Mapping) and self.sites is not None:
            extra = set(omega) - self.sites
            if extra:
                raise ValueError(f"polya_gamma: omega given for sites {sorted(extra)} that are "
                                 "not among the sites to rewrite")
        super().__init__()
        self.omega = omega

    def _pyro_sample(self, msg) -> None:
        named = self.sites is not None and msg["name"] in self.sites
        wrappers, base = unwrap(msg["fn"])
        is_bernoulli = isinstance(base, torch.distributions.Bernoulli)
        observed, value = observation(self, msg)
        if named and not (observed and is_bernoulli):
            raise ValueError(f"polya_gamma: site '{msg['name']}' is not an observed Bernoulli "
                             f"site (it is {type(base).__name__})")
        if not (observed and is_bernoulli) or (self.sites is not None and not named):
            return
        value = torch.as_tensor(value)
        logits = base.logits.expand(value.shape)
        omega = torch.as_tensor(self._omega_for(msg["name"]), dtype=logits.dtype)
        omega = omega.expand(value.shape)
        _check_concrete(msg["name"], value, logits, msg["mask"])
        new: torch.distributions.Distribution = PolyaGammaBernoulli(logits, omega)
        for w in reversed(wrappers):
            new = w(new)
        msg["fn"] = new
        kappa = value.to(logits.dtype) - 0.5
        msg["infer"] = {**msg["infer"],
                        "polya_gamma": {"logits": logits, "kappa": kappa, "omega": omega}}

    def _pyro_post_sample(self, msg) -> None:
        if (msg["is_observed"] and "polya_gamma" not in msg["infer"]
                and (self.sites is None or msg["name"] in self.sites)
                and isinstance(unwrap(msg["fn"])[1], torch.distributions.Bernoulli)):
            raise ValueError(f"polya_gamma: site '{msg['name']}' was observed by a handler "
                             "enclosing polya_gamma after polya_gamma saw it as latent; apply "
                             "polya_gamma outside that handler")

    def _omega_for(self, name: str):
        if self.omega is None:
            return 0.25
        if isinstance(self.omega, Mapping):
            if name not in self.omega:
                raise ValueError(f"polya_gamma: no omega given for site '{name}'")
            return self.omega[name]
        return self.omega


def polya_gamma(fn: Callable | None = None,
                omega: Tensor | float | Mapping[str, Tensor] | None = None,
                sites: Iterable[str] | None = None):
    """The :class:`PolyaGammaMessenger` around ``fn`` (or the messenger itself, for ``with``)."""
    msngr = PolyaGammaMessenger(omega, sites)
    return msngr(fn) if fn is not None else msngr


def unwrap(fn):
    """Peel ``Independent`` and expansions: re-wrapping functions and the base distribution."""
    wrappers: list[Callable] = []
    while True:
        if isinstance(fn, dist.MaskedDistribution):
            wrappers.append(lambda d, m=fn._mask: d.mask(m))
        elif isinstance(fn, torch.distributions.Independent):
            wrappers.append(lambda d, n=fn.reinterpreted_batch_ndims: d.to_event(n))
        elif isinstance(fn, dist.ExpandedDistribution):
            wrappers.append(lambda d, s=fn.batch_shape: d.expand(s))
        else:
            return wrappers, fn
        fn = fn.base_dist


def _wrapped(t) -> bool:
    """Whether ``t`` is a tensor inside a ``torch.func`` transform (values not inspectable)."""
    is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return isinstance(t, Tensor) and is_wrapped is not None and bool(is_wrapped(t))


def _check_concrete(name: str, value: Tensor, logits: Tensor, mask) -> None:
    """Labels in {0, 1} and finite logits at the unmasked rows, when the values are concrete."""
    if any(_wrapped(a) for a in (value, logits, mask)):
        return
    keep = torch.ones(value.shape, dtype=torch.bool)
    if mask is not None:
        keep = keep & torch.as_tensor(mask, dtype=torch.bool).expand(value.shape)
    y = value.detach()
    bad = keep & ~((y == 0) | (y == 1))
    if bad.any():
        shown = torch.unique(y[bad])[:5].tolist()
        raise ValueError(f"polya_gamma: site '{name}' has labels {shown} outside {{0, 1}} "
                         "(Bernoulli labels must be 0 or 1; map -1/1 labels with (y + 1) / 2)")
    if (keep & ~torch.isfinite(logits.detach())).any():
        raise ValueError(f"polya_gamma: site '{name}' has non-finite logits (NaN or infinite "
                         "inputs?)")
