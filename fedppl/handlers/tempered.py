"""``tempered``: scale the KL term of chosen latent sites by ``alpha``.

The KL between guide and prior at a site is ``E_q[log q - log p]``; it appears in the ELBO through
the model's prior term and the guide's entropy term. Wrap *both* the model and the guide, and each
of the named latent sites contributes ``alpha * (log p - log q)``: the HVM's alpha-scaled
``KL[q(Z) || q_cavity(Z)]`` (Sec. 4 of the federated sparse GP paper). Observed sites and other
sites are untouched; a named site observed by ``numpyro.handlers.condition`` (in either nesting)
is observed, so it is not scaled.

The guide must sample each named site directly (``numpyro.sample("Z", dist.Normal(...))``). A
guide that draws it through an auxiliary site (as AutoContinuous and ``PVIGuide`` do, with a
Delta at the named site) keeps its entropy term unscaled.

Example::

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.handlers import seed, trace
    >>> from numpyro.infer import Trace_ELBO, TraceMeanField_ELBO
    >>> def model(y):
    ...     Z = numpyro.sample("Z", dist.Normal(0.0, 1.0))
    ...     numpyro.sample("y", dist.Normal(Z, 1.0), obs=y)
    >>> def guide(y):
    ...     numpyro.sample("Z", dist.Normal(1.0, 0.5))
    >>> tr = trace(seed(tempered(model, alpha=0.1, sites=["Z"]), 0)).get_trace(1.0)
    >>> tr["Z"]["scale"], tr["y"]["scale"]                 # the observed site is untouched
    (0.1, None)
    >>> key, params, y = jax.random.key(0), {}, 1.0
    >>> loss = Trace_ELBO().loss(key, params, tempered(model, alpha=0.1, sites=["Z"]),
    ...                          tempered(guide, alpha=0.1, sites=["Z"]), y)
    >>> bool(jax.numpy.isfinite(loss))
    True

    With an analytic KL and the same key (so the same likelihood term), the loss moves by
    ``alpha * KL[q(Z) || p(Z)]``:

    >>> def loss(alpha):
    ...     return TraceMeanField_ELBO().loss(key, params,
    ...                                       tempered(model, alpha=alpha, sites=["Z"]),
    ...                                       tempered(guide, alpha=alpha, sites=["Z"]), y)
    >>> kl = dist.kl_divergence(dist.Normal(1.0, 0.5), dist.Normal(0.0, 1.0))
    >>> round(float(loss(0.1) - loss(0.0)), 3), round(float(0.1 * kl), 3)
    (0.082, 0.082)
"""

from __future__ import annotations

from collections.abc import Iterable

from numpyro.primitives import Messenger

from fedppl.handlers._observed import observation

__all__ = ["tempered"]


class tempered(Messenger):
    """Multiply the log density of the named latent sample sites by ``alpha``.

    :param fn: a model or a guide (apply it to both for a scaled KL).
    :param alpha: the scale, ``alpha >= 0``.
    :param sites: names of latent sites to scale.
    """

    def __init__(self, fn=None, alpha: float = 1.0, sites: Iterable[str] = ()):
        if not (alpha >= 0):
            raise ValueError(f"alpha must be non-negative, got {alpha}")
        self.alpha = alpha
        self.sites = frozenset(sites)
        if not self.sites:
            raise ValueError("tempered needs at least one site name")
        super().__init__(fn)

    def process_message(self, msg):
        if (msg["type"] == "sample" and msg["name"] in self.sites
                and not observation(self, msg)[0]):  # a site `condition` observes is not latent
            msg["scale"] = self.alpha if msg["scale"] is None else self.alpha * msg["scale"]
