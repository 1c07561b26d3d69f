"""``polya_gamma``: make Bernoulli-logit observations conditionally Gaussian in their logits.

With ``kappa = y - 1/2`` and ``omega ~ PG(1, 0)``, a Bernoulli observation with logit ``f`` has
``p(y | f) = 1/2 exp(kappa f) E[exp(-omega f^2 / 2)]``. Given ``E[omega]`` under a variational
``q(omega) = PG(1, c)`` (supplied by the caller, one per observation), this handler replaces the
site's log density by

    E_q(omega)[log p(y | f, omega)] = -log 2 + kappa f - E[omega] f^2 / 2,

a Gaussian site in ``f`` (pseudo-observation ``kappa / E[omega]``, precision ``E[omega]``). The
ELBO of the augmented model is this term minus ``KL[q(omega) || PG(1, 0)]``
(:func:`fedppl.families.polya_gamma.kl_to_prior`), which does not depend on ``f``. Without
``omega`` the prior mean ``E[omega] = 1/4`` is used: Bohning's fixed quadratic lower bound.

A site is observed through ``obs=`` or through ``numpyro.handlers.condition`` in either nesting
(``condition(polya_gamma(model), {"y": y})`` rewrites ``y`` just as ``polya_gamma(condition(...))``
does); a Bernoulli site observed by another handler outside this one raises ``ValueError``.

Labels must be in {0, 1} (NumPyro's Bernoulli encoding; map {-1, 1} labels with ``(y + 1) / 2``).
Labels outside {0, 1}, or non-finite logits, raise a ``ValueError`` naming the site when the values
are concrete (under ``jit`` they cannot be inspected: validate first, as ``fedppl.PVI`` does).
Masked rows keep their mask and are not checked when the mask is visible to the handler: write
``polya_gamma(client(model, mask=m))`` (the mask is applied first) so that padding is ignored.
Each rewritten site records ``msg["infer"]["polya_gamma"] = {"logits", "kappa", "omega"}``
(arrays shaped like the site's value), which a CAVI step reads from the trace.

Example::

    >>> import jax.numpy as jnp, numpyro.distributions as dist
    >>> from numpyro.handlers import substitute, trace, seed
    >>> from fedppl.models import logistic_regression
    >>> X = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]])
    >>> y = jnp.array([1.0, 0.0, 1.0, 0.0])
    >>> params = {"w": jnp.array([0.5, -1.0]), "b": jnp.array(0.2)}
    >>> model = substitute(logistic_regression, params)
    >>> e_omega = jnp.full(4, 0.2)                            # E[omega], one per observation
    >>> tr = trace(seed(polya_gamma(model, omega={"y": e_omega}), 0)).get_trace(X, y)
    >>> f = tr["y"]["infer"]["polya_gamma"]["logits"]         # (N,)
    >>> f.shape, bool(jnp.allclose(f, X @ params["w"] + params["b"]))
    ((4,), True)
    >>> bound = -jnp.log(2.0) + (y - 0.5) * f - e_omega * f**2 / 2
    >>> bool(jnp.allclose(tr["y"]["fn"].log_prob(y), bound))
    True

    Without ``omega``, Bohning's bound lies below the exact Bernoulli log likelihood:

    >>> tr = trace(seed(polya_gamma(model), 0)).get_trace(X, y)
    >>> bool((tr["y"]["fn"].log_prob(y) <= dist.Bernoulli(logits=f).log_prob(y)).all())
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from jax import Array
from numpyro.distributions import constraints
from numpyro.primitives import Messenger

from fedppl.handlers._observed import observation

__all__ = ["polya_gamma", "PolyaGammaBernoulli"]


class PolyaGammaBernoulli(dist.Distribution):
    """The augmented Bernoulli term: ``log_prob(y) = -log 2 + (y - 1/2) f - omega f^2 / 2``.

    Not normalised in ``y``: it is ``E_q(omega)[log p(y | f, omega)]``, a lower bound on the
    Bernoulli log likelihood once ``KL[q(omega) || PG(1, 0)]`` is subtracted. ``sample`` draws from
    ``Bernoulli(logits=f)``.
    """

    # numpyro's Distribution declares arg_constraints a plain (not ClassVar) dict attribute.
    arg_constraints = {"logits": constraints.real, "omega": constraints.positive}  # noqa: RUF012
    support = constraints.boolean

    def __init__(self, logits: Array, omega: Array, *, validate_args: bool | None = None):
        batch_shape = jax.lax.broadcast_shapes(jnp.shape(logits), jnp.shape(omega))
        self.logits = jnp.broadcast_to(logits, batch_shape)
        self.omega = jnp.broadcast_to(omega, batch_shape)
        super().__init__(batch_shape, validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        return dist.BernoulliLogits(self.logits).sample(key, sample_shape)

    def log_prob(self, value):
        f = self.logits
        return -jnp.log(2.0) + (value - 0.5) * f - 0.5 * self.omega * f**2


class polya_gamma(Messenger):
    """Rewrite observed Bernoulli sites into their Polya-Gamma augmented form (see module doc).

    :param fn: a NumPyro model.
    :param omega: ``E[omega]`` per observation: an array broadcastable to the site's value (when
        one site is rewritten) or ``{site name: array}``; ``None`` uses ``1/4`` (``c = 0``).
    :param sites: names of the observed Bernoulli sites to rewrite; by default every observed
        Bernoulli site (other observed sites are left alone). A named site that is not an observed
        Bernoulli raises ``ValueError``.
    """

    def __init__(self, fn=None, omega: Array | Mapping[str, Array] | None = None,
                 sites: Iterable[str] | None = None):
        self.sites = None if sites is None else frozenset(sites)
        if self.sites is not None and not self.sites:
            raise ValueError("polya_gamma: sites is empty; pass None to rewrite every Bernoulli")
        if isinstance(omega, Mapping) and self.sites is not None:
            extra = set(omega) - self.sites
            if extra:
                raise ValueError(f"polya_gamma: omega given for sites {sorted(extra)} that are "
                                 "not among the sites to rewrite")
        self.omega = omega
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        named = self.sites is not None and msg["name"] in self.sites
        wrappers, base, keep = _unwrap(msg["fn"])
        is_bernoulli = isinstance(base, (dist.BernoulliLogits, dist.BernoulliProbs))
        observed, value = observation(self, msg)  # also when an enclosing `condition` observes it
        if named and not (observed and is_bernoulli):
            raise ValueError(f"polya_gamma: site '{msg['name']}' is not an observed Bernoulli "
                             f"site (it is {type(base).__name__})")
        if not (observed and is_bernoulli) or (self.sites is not None and not named):
            return
        shape = jnp.shape(value)
        logits = jnp.broadcast_to(base.logits, shape)
        omega = jnp.broadcast_to(self._omega_for(msg["name"], logits.dtype), shape)
        _check_concrete(msg["name"], value, logits, keep)
        new = PolyaGammaBernoulli(logits, omega)
        for w in reversed(wrappers):
            new = w(new)
        msg["fn"] = new
        kappa = jnp.asarray(value, logits.dtype) - 0.5
        msg["infer"] = {**msg["infer"],
                        "polya_gamma": {"logits": logits, "kappa": kappa, "omega": omega}}

    def postprocess_message(self, msg):
        # a Bernoulli site observed by a handler that `observation` cannot foresee
        if (msg["type"] == "sample" and msg["is_observed"] and "polya_gamma" not in msg["infer"]
                and (self.sites is None or msg["name"] in self.sites)
                and isinstance(_unwrap(msg["fn"])[1], (dist.BernoulliLogits, dist.BernoulliProbs))):
            raise ValueError(f"polya_gamma: site '{msg['name']}' was observed by a handler "
                             "enclosing polya_gamma after polya_gamma saw it as latent; apply "
                             "polya_gamma outside that handler")

    def _omega_for(self, name: str, dtype) -> Array:
        if self.omega is None:
            return jnp.asarray(0.25, dtype)
        if isinstance(self.omega, Mapping):
            if name not in self.omega:
                raise ValueError(f"polya_gamma: no omega given for site '{name}'")
            return jnp.asarray(self.omega[name], dtype)
        return jnp.asarray(self.omega, dtype)


def _unwrap(fn: dist.Distribution):
    """Peel masks, ``Independent`` and expansions: re-wrapping functions, the base distribution
    and the combined mask (broadcastable to the value; ``None`` when there is none)."""
    wrappers, keep = [], None
    while True:
        if isinstance(fn, dist.MaskedDistribution):
            m = jnp.asarray(fn._mask)
            m = jnp.reshape(m, jnp.shape(m) + (1,) * len(fn.event_shape))
            keep = m if keep is None else keep & m
            wrappers.append(lambda d, m=fn._mask: d.mask(m))
        elif isinstance(fn, dist.Independent):
            wrappers.append(lambda d, n=fn.reinterpreted_batch_ndims: d.to_event(n))
        elif isinstance(fn, dist.ExpandedDistribution):
            wrappers.append(lambda d, s=fn.batch_shape: d.expand(s))
        else:
            return wrappers, fn, keep
        fn = fn.base_dist


def _check_concrete(name: str, value: Array, logits: Array, mask: Array | None) -> None:
    """Labels in {0, 1} and finite logits at the unmasked rows, when the values are concrete."""
    if any(isinstance(a, jax.core.Tracer) for a in (value, logits, mask)):
        return
    y = np.asarray(value, dtype=float)
    keep = np.broadcast_to(True if mask is None else np.asarray(mask, bool), y.shape)
    bad = keep & ~((y == 0.0) | (y == 1.0))
    if bad.any():
        shown = np.unique(y[bad])[:5].tolist()
        raise ValueError(f"polya_gamma: site '{name}' has labels {shown} outside {{0, 1}} "
                         "(Bernoulli labels must be 0 or 1; map -1/1 labels with (y + 1) / 2)")
    if (keep & ~np.isfinite(np.asarray(logits))).any():
        raise ValueError(f"polya_gamma: site '{name}' has non-finite logits (NaN or infinite "
                         "inputs?)")
