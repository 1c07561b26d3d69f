"""Closed-form PVI local updates for Bernoulli-logit models by Polya-Gamma CAVI.

:class:`PolyaGammaSolver` is a PVI local solver (same call as ``ConjugateSolver``): client ``k``
runs CAVI (:mod:`fedppl.guides.cavi`) with its cavity as the prior, warm-started at the current
``q``, until ``c`` stops moving or ``max_iters`` sweeps. Its local objective is the
Jaakkola-Jordan bound of its likelihood, so the PVI fixed point is the global CAVI (JJ) posterior
of the pooled data (a looser bound than the exact logistic likelihood of Gaussian VI: the means
are close to Gaussian VI's, the standard deviations come out smaller; see the pvi_polya_gamma
benchmark page in the docs). No learning rate and no Monte Carlo noise; the number of rounds
follows CAVI's own linear convergence, which is slow on ill-conditioned, nearly separable data.

Masked (padded) rows contribute nothing; a client whose rows are all masked returns its cavity,
so its factor stays where it is (the identity, if it started there). Labels must be 0 or 1:
:func:`validate` checks every client before the run and names the first bad one.

Example::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import logistic_regression
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(30, 2))
    >>> y = (X @ np.array([1.5, -1.0]) + 0.3 * rng.normal(size=30) > 0).astype(float)
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=2, seed=0)
    >>> pvi = fedppl.PVI(logistic_regression, PVIGuide(logistic_regression, family="fullrank"),
    ...                  conjugate="polya-gamma")
    >>> result = pvi.run(jax.random.key(0), clients, num_rounds=2, progress_bar=False)
    >>> result.q.prec.shape                                  # full rank over (w, b)
    (3, 3)
    >>> w = result.posterior["w"].mean
    >>> bool(w[0] > 0), bool(w[1] < 0)                       # the signs of the true weights
    (True, True)
    >>> kl_change = result.history["kl_change"]              # q settles round by round
    >>> bool(kl_change[-1] < kl_change[0])
    True

    Labels in {-1, 1} are caught before the run, naming the client:

    >>> bad = fedppl.partition.homogeneous(X, 2 * y - 1, num_clients=2, seed=0)
    >>> try:
    ...     validate(logistic_regression, PVIGuide(logistic_regression), bad)
    ... except ValueError as e:
    ...     print(str(e).split(":")[0])
    client 0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedppl.algorithms.natural_gradient import LocalResult
from fedppl.clients import Clients
from fedppl.guides import cavi
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client

__all__ = ["PolyaGammaSolver", "validate"]


class PolyaGammaSolver(NamedTuple):
    """Client ``k``'s local free energy maximised by Polya-Gamma CAVI (see module doc).

    :param model: a NumPyro model with Bernoulli-logit observations affine in the global sites.
    :param guide: the :class:`PVIGuide` (its family decides full-rank or mean-field updates).
    :param max_iters: most CAVI sweeps per client update.
    :param tol: stop when ``max |c - c_prev| <= tol (1 + |c|)``.
    """

    model: Callable
    guide: PVIGuide
    max_iters: int = 200
    tol: float = 1e-10

    def __call__(self, q_cavity, q, data, mask, rng_key):
        layout = self.guide.layout
        assert layout is not None  # the guide is set up before its solver runs
        lik = cavi.logit_terms(client(self.model, mask=mask), layout, *data)
        q_new, sweeps = cavi.iterate(q_cavity, lik, q, self.max_iters, self.tol)
        return LocalResult(q_new, cavi.elbo(q_new, q_cavity, lik), sweeps < self.max_iters, sweeps)


def validate(model: Callable, guide: PVIGuide, clients: Clients) -> None:
    """Raise ``ValueError`` naming the client if the model is not Bernoulli-logit and affine in
    the global sites (checked on the first client), or a client's labels are outside {0, 1} or
    its logits are not finite (every client, in one compiled pass over the padded data)."""
    guide.setup(*clients.client(0))
    layout, name0 = guide.layout, clients.names[0]
    assert layout is not None  # setup builds it
    arrays = clients.client(0)
    try:
        reason = cavi.check(client(model, mask=np.ones(len(arrays[0]), bool)), layout, *arrays)
    except ValueError as e:
        raise ValueError(f"{name0}: {e}") from e
    if reason is not None:
        raise ValueError(f"{name0}: the Polya-Gamma solver needs Bernoulli logits affine in the "
                         f"global sites: {reason}")

    @jax.jit
    @jax.vmap
    def values(data, mask):
        return cavi.logit_values(client(model, mask=mask), layout, jnp.zeros(layout.dim), data, {})

    logits, kappa, weight = (np.asarray(a) for a in values(clients.stacked, clients.mask))
    for k, name in enumerate(clients.names):
        keep = weight[k] > 0
        labels = kappa[k][keep] + 0.5
        bad = ~((labels == 0.0) | (labels == 1.0))
        if bad.any():
            raise ValueError(f"{name}: labels {np.unique(labels[bad])[:5].tolist()} of an "
                             "observed Bernoulli site are outside {0, 1}")
        if not np.all(np.isfinite(logits[k][keep])):
            raise ValueError(f"{name}: non-finite logits at an observed Bernoulli site")
