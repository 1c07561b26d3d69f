"""``cavity``: put the PVI cavity distribution where the model's prior over global sites was.

Under this handler the ordinary ELBO of a client's model, with a guide over the same global sites,
is that client's local free energy

    E_q[log p(y_k | theta)] - KL(q || q_cavity),

because at each global site the prior log density is replaced by the cavity's. The cavity is one
Gaussian over the flat unconstrained vector ``theta`` of :class:`~fedppl.sites.SiteLayout`; at each
site the handler uses its conditional given the sites already sampled (for a mean-field cavity this
is the marginal), so the site terms add up to the joint log density ``log q_cavity(theta)``. Sites
are mapped to their support with the same bijections the guide uses, so Jacobians cancel.

A global site that has a value (``numpyro.handlers.condition``, in either nesting, or
``substitute``) keeps the cavity's density there, so the sites left latent see the cavity's
conditional given it. A global site the handler never sees (``block(hide=...)`` inside it) is
marginalised out: the other sites' terms add up to the cavity's marginal over them. Each site is
conditioned on the sites seen before it, in whatever order the model samples them. Masks put
on a site inside the handler (``numpyro.handlers.mask``) stay on the cavity's distribution.

Example::

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import Trace_ELBO
    >>> from numpyro.infer.util import log_density
    >>> def model(X, y=None):
    ...     w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with numpyro.plate("data", X.shape[0]):
    ...         numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> X, y = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), jnp.array([0.5, -0.5, 0.0])
    >>> layout = SiteLayout.from_model(model, X, y)
    >>> q_cav = DiagGaussian.from_moments(jnp.array([1.0, -1.0]), jnp.array([0.25, 0.25]))

    The prior ``N(0, 1)`` of ``w`` is now the cavity ``N((1, -1), 0.5^2)``:

    >>> w = jnp.array([0.5, 0.5])
    >>> lp, _ = log_density(cavity(model, q_cav, layout), (X, y), {}, {"w": w})
    >>> by_hand = (dist.Normal(X @ w, 1.0).log_prob(y).sum()
    ...            + dist.Normal(jnp.array([1.0, -1.0]), 0.5).log_prob(w).sum())
    >>> round(float(lp), 3) == round(float(by_hand), 3)
    True
    >>> def guide(X, y=None):
    ...     numpyro.sample("w", dist.Normal(jnp.zeros(2), 0.5).to_event(1))
    >>> key, params = jax.random.key(0), {}
    >>> free_energy = -Trace_ELBO().loss(key, params, cavity(model, q_cav, layout), guide, X, y)
    >>> bool(jnp.isfinite(free_energy))
    True
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpyro.distributions as dist
from numpyro.primitives import Messenger

from fedppl.families.gaussian import DiagGaussian, Gaussian, mean_and_scale_tril
from fedppl.sites import SiteLayout, transformed

__all__ = ["cavity"]


class cavity(Messenger):
    """Replace the prior at the global sites of ``layout`` by ``q_cavity`` (see module doc).

    :param fn: a NumPyro model.
    :param q_cavity: the cavity, a Gaussian over the layout's flat unconstrained vector.
    :param layout: the global sites (their order, shapes and bijections).
    """

    def __init__(self, fn=None, q_cavity: Gaussian | None = None, layout: SiteLayout | None = None):
        if q_cavity is None or layout is None:
            raise ValueError("cavity needs both q_cavity and layout")
        if q_cavity.dim != layout.dim:
            raise ValueError(
                f"q_cavity has dimension {q_cavity.dim} but the global sites have {layout.dim}"
            )
        self.q_cavity = q_cavity
        self.layout = layout
        self._run: dict | None = None
        super().__init__(fn)

    # Per-call state (values of sites already seen, the cavity's moments) lives in ``_run`` only
    # between __enter__ and __exit__, so no tracer outlives the call that made it.
    def __enter__(self):
        self._run = {"theta": {}, "moments": None}
        return super().__enter__()

    def __exit__(self, *args, **kwargs):
        self._run = None
        return super().__exit__(*args, **kwargs)

    def process_message(self, msg):
        if not self._is_global(msg):
            return
        site = self.layout[msg["name"]]
        run = self._run
        assert run is not None  # sites are processed only between __enter__ and __exit__
        if run["moments"] is None:
            run["moments"] = mean_and_scale_tril(self.q_cavity)
        mean, sc = run["moments"]
        a, b = site.start, site.start + site.size
        if isinstance(self.q_cavity, DiagGaussian):
            base = dist.Normal(mean[a:b], sc[a:b]).to_event(1)
        else:
            base = self._conditional(mean, sc, site, run["theta"])
        msg["fn"] = _with_masks(msg["fn"], transformed(base, site))

    def postprocess_message(self, msg):
        if self._is_global(msg) and self._run is not None:
            site = self.layout[msg["name"]]
            self._run["theta"][site.name] = jnp.reshape(site.transform.inv(msg["value"]), (-1,))

    def _is_global(self, msg) -> bool:
        # observed or not: a global site given a value by `condition` keeps the cavity's density
        return msg["type"] == "sample" and msg["name"] in self.layout.names

    def _conditional(self, mean, sc, site, theta: dict) -> dist.Distribution:
        """The full-rank cavity at ``site`` given the global sites seen so far in this call
        (their unconstrained values ``theta``)."""
        seen = sorted((self.layout[n] for n in theta), key=lambda s: s.start)
        idx = [i for s in [*seen, site] for i in range(s.start, s.start + s.size)]
        p = len(idx) - site.size
        if idx == list(range(len(idx))):  # the sites before it in the layout: slice the factor
            chol = sc[: len(idx), : len(idx)]
        else:  # a gap (a site hidden from the handler, or sampled later): marginalise it out
            rows = sc[jnp.asarray(idx)]
            chol = jnp.linalg.cholesky(rows @ rows.T)
        loc = mean[site.start: site.start + site.size]
        if p > 0:
            prev = jnp.concatenate([theta[s.name] for s in seen])
            eps = jsl.solve_triangular(chol[:p, :p], prev - mean[jnp.asarray(idx[:p])], lower=True)
            loc = loc + chol[p:, :p] @ eps
        return dist.MultivariateNormal(loc, scale_tril=chol[p:, p:])


def _with_masks(prior: dist.Distribution, fn: dist.Distribution) -> dist.Distribution:
    """``fn`` under the masks around ``prior`` (``numpyro.handlers.mask`` inside the handler)."""
    while isinstance(prior, dist.MaskedDistribution):
        fn, prior = fn.mask(prior._mask), prior.base_dist
    return fn
