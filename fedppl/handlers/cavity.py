"""``cavity``: put the PVI cavity distribution where the model's prior over global sites was.

Under this handler the ordinary ELBO of a client's model, with a guide over the same global sites,
is that client's local free energy

    E_q[log p(y_k | theta)] - KL(q || q_cavity),

because at each global site the prior log density is replaced by the cavity's. The cavity is one
Gaussian over the flat unconstrained vector ``theta`` of :class:`~fedppl.sites.SiteLayout`; at each
site the handler uses its conditional given the sites already sampled (for a mean-field cavity this
is the marginal), so the site terms add up to the joint log density ``log q_cavity(theta)``. Sites
are mapped to their support with the same bijections the guide uses, so Jacobians cancel.

Example::

    >>> from numpyro.infer import Trace_ELBO
    >>> free_energy = -Trace_ELBO().loss(key, params, cavity(model, q_cav, layout), guide, X, y)
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
        if self._run["moments"] is None:
            self._run["moments"] = mean_and_scale_tril(self.q_cavity)
        mean, sc = self._run["moments"]
        a, b = site.start, site.start + site.size
        if isinstance(self.q_cavity, DiagGaussian):
            base = dist.Normal(mean[a:b], sc[a:b]).to_event(1)
        else:
            cond_mean = mean[a:b]
            if a > 0:
                prev = self._previous(a)
                eps = jsl.solve_triangular(sc[:a, :a], prev - mean[:a], lower=True)
                cond_mean = cond_mean + sc[a:b, :a] @ eps
            base = dist.MultivariateNormal(cond_mean, scale_tril=sc[a:b, a:b])
        msg["fn"] = transformed(base, site)

    def postprocess_message(self, msg):
        if self._is_global(msg) and self._run is not None:
            site = self.layout[msg["name"]]
            self._run["theta"][site.name] = jnp.reshape(site.transform.inv(msg["value"]), (-1,))

    def _is_global(self, msg) -> bool:
        return (
            msg["type"] == "sample"
            and not msg["is_observed"]
            and msg["name"] in self.layout.names
        )

    def _previous(self, start: int):
        parts = []
        for s in self.layout.sites:
            if s.start >= start:
                break
            if s.name not in self._run["theta"]:
                raise RuntimeError(
                    f"global site '{s.name}' was not sampled before later global sites; the "
                    "model must sample its global sites in the same order on every call"
                )
            parts.append(self._run["theta"][s.name])
        return jnp.concatenate(parts)
