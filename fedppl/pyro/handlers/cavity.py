"""``cavity``: put the PVI cavity distribution where a Pyro model's prior over global sites was.

The messenger twin of :class:`fedppl.handlers.cavity`. Under it the ordinary ELBO of a client's
model, with a guide over the same global sites, is the client's local free energy
``E_q[log p(y_k | theta)] - KL(q || q_cavity)``: at each global site of the
:class:`~fedppl.pyro.sites.SiteLayout` the prior is replaced by the cavity's conditional given the
global sites already sampled in this call (for a mean-field cavity, its marginal), pushed to the
site's support with the bijection the guide uses, so the site terms add up to ``log
q_cavity(theta)`` and Jacobians cancel. A site given a value (``poutine.condition``, in either
nesting, or ``replay``) keeps the cavity's density there; a site the messenger never sees (``block``
inside it) is marginalised out. Pyro keeps masks (``poutine.mask``) and scales
(``poutine.scale``) on the message, so they stay on the cavity's term.

Example::

    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro import poutine
    >>> from fedppl.pyro.families.gaussian import DiagGaussian
    >>> from fedppl.pyro.sites import SiteLayout
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> X, y = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), torch.tensor([0.5, -0.5, 0.0])
    >>> layout = SiteLayout.from_model(model, X, y)
    >>> q_cav = DiagGaussian.from_moments(torch.tensor([1.0, -1.0]), torch.tensor([0.25, 0.25]))
    >>> w = torch.tensor([0.5, 0.5])
    >>> conditioned = poutine.condition(cavity(model, q_cav, layout), {"w": w})
    >>> tr = poutine.trace(conditioned).get_trace(X, y)
    >>> by_hand = (dist.Normal(X @ w, 1.0).log_prob(y).sum()
    ...            + dist.Normal(torch.tensor([1.0, -1.0]), 0.5).log_prob(w).sum())
    >>> bool(torch.isclose(tr.log_prob_sum(), by_hand))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyro.distributions as dist
import torch
from pyro.poutine.messenger import Messenger

from fedppl.pyro.families.gaussian import DiagGaussian, Gaussian, mean_and_scale_tril
from fedppl.pyro.sites import SiteLayout, transformed

__all__ = ["cavity", "CavityMessenger"]


class CavityMessenger(Messenger):
    """Replace the prior at the global sites of ``layout`` by ``q_cavity`` (see module doc).

    :param q_cavity: the cavity, a Gaussian over the layout's flat unconstrained vector.
    :param layout: the global sites (their order, shapes and bijections).
    """

    def __init__(self, q_cavity: Gaussian | None = None, layout: SiteLayout | None = None):
        if q_cavity is None or layout is None:
            raise ValueError("cavity needs both q_cavity and layout")
        if q_cavity.dim != layout.dim:
            raise ValueError(
                f"q_cavity has dimension {q_cavity.dim} but the global sites have {layout.dim}")
        super().__init__()
        self.q_cavity = q_cavity
        self.layout = layout
        self._run: dict | None = None

    # per-call state: the unconstrained values of the global sites seen so far in this call
    def __enter__(self):
        self._run = {"theta": {}, "moments": None}
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        self._run = None
        return super().__exit__(*args)

    def _is_global(self, msg) -> bool:
        return msg["type"] == "sample" and msg["name"] in self.layout.names

    def _pyro_sample(self, msg) -> None:
        if not self._is_global(msg) or self._run is None:
            return
        site = self.layout[msg["name"]]
        run = self._run
        if run["moments"] is None:
            run["moments"] = mean_and_scale_tril(self.q_cavity)
        mean, sc = run["moments"]
        a, b = site.start, site.start + site.size
        if isinstance(self.q_cavity, DiagGaussian):
            base = dist.Normal(mean[a:b], sc[a:b]).to_event(1)
        else:
            base = self._conditional(mean, sc, site, run["theta"])
        msg["fn"] = transformed(base, site)

    def _pyro_post_sample(self, msg) -> None:
        if self._is_global(msg) and self._run is not None:
            site = self.layout[msg["name"]]
            self._run["theta"][site.name] = site.transform.inv(msg["value"]).reshape(-1)

    def _conditional(self, mean, sc, site, theta: dict) -> dist.Distribution:
        """The full-rank cavity at ``site`` given the global sites seen so far in this call."""
        seen = sorted((self.layout[n] for n in theta), key=lambda s: s.start)
        idx = [i for s in [*seen, site] for i in range(s.start, s.start + s.size)]
        p = len(idx) - site.size
        if idx == list(range(len(idx))):  # the sites before it in the layout: slice the factor
            chol = sc[: len(idx), : len(idx)]
        else:  # a gap (a hidden site, or one sampled later): marginalise it out
            rows = sc[torch.as_tensor(idx)]
            chol = torch.linalg.cholesky(rows @ rows.T)
        loc = mean[site.start: site.start + site.size]
        if p > 0:
            prev = torch.cat([theta[s.name] for s in seen])
            diff = (prev - mean[torch.as_tensor(idx[:p])]).unsqueeze(-1)
            eps = torch.linalg.solve_triangular(chol[:p, :p], diff, upper=False).squeeze(-1)
            loc = loc + chol[p:, :p] @ eps
        return dist.MultivariateNormal(loc, scale_tril=chol[p:, p:])


def cavity(fn: Callable | None = None, q_cavity: Gaussian | None = None,
           layout: SiteLayout | None = None):
    """The :class:`CavityMessenger` around ``fn`` (or the messenger itself, for ``with``)."""
    msngr = CavityMessenger(q_cavity, layout)
    return msngr(fn) if fn is not None else msngr
