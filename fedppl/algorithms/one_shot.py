"""One-shot baselines: every client approximates its subposterior once, the server combines.

Client ``k``'s subposterior is ``s_k(theta) ∝ p(theta)^(1/K) p(y_k | theta)``, so that
``prod_k s_k ∝ p(theta | y)``. Each client fits a Gaussian ``N_k`` to ``s_k``:

* **Laplace** (:class:`TiltedLaplace`): the mode of ``s_k`` (optax's L-BFGS with its line
  search) and the Hessian of ``-log s_k`` there as the precision. With local sites the mode is
  joint over ``(theta, z_k)``; ``theta``'s precision is the Schur complement of the joint
  Hessian (the Laplace marginal) and the client keeps ``q(z_k | theta)``, the joint's conditional;
* **parametric** (Neiswanger et al. 2014; numpyro's ``hmc_util.parametric``): the mean and
  covariance of NUTS draws of ``s_k``, with EP's sampler and estimator
  (:class:`fedppl.algorithms.ep.TiltedNUTS`);
* **consensus** (Scott et al. 2016; numpyro's ``hmc_util.consensus``): the same draws are sent as
  well, and the server averages them across clients, weighted by the inverse sample covariances
  (:func:`consensus_draws`).

The client's site is ``t_k = N_k / p^(1/K)`` (a difference of natural parameters), so the server's
``q = p prod_k t_k = prod_k N_k``, the parametric product of the subposterior approximations; its
sites are also where PVI or EP can start (``run(..., factors=result.factors)``). This is EP's
client step (:func:`fedppl.algorithms.ep.client_update`) with the cavity fixed at
``p^(1/K)`` and no damping, and PVI's server: one round of the same trio.

Example (Laplace on Bayesian linear regression: the subposteriors are Gaussian, so their product
is the exact posterior)::

    >>> import jax, jax.numpy as jnp, numpy as np, fedppl
    >>> from fedppl.families import gaussian as g
    >>> from fedppl.algorithms import pvi
    >>> from fedppl.models import linear_regression
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> guide = fedppl.PVIGuide(linear_regression, family="fullrank").setup(*clients.client(0))
    >>> trio = make_trio(TiltedLaplace(linear_regression, guide), guide.prior, 3)
    >>> flat = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), g.zeros_like(guide.prior))
    >>> server = pvi.init(guide.prior, flat)
    >>> msgs, _ = jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0))(
    ...     server, pvi.ClientState(flat), clients.stacked, clients.mask,
    ...     jax.random.split(jax.random.key(0), 3), jnp.arange(3))
    >>> state, _ = trio.server_update(server, msgs, jnp.arange(3), jnp.ones(3, bool), None, None)
    >>> Xb = np.c_[X, np.ones(60)]
    >>> exact = np.linalg.solve(np.eye(3) + Xb.T @ Xb, Xb.T @ (X @ np.ones(2)))
    >>> bool(np.allclose(g.to_moments(state.q)[0], exact, atol=1e-6))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax
from jax import Array

from fedppl.algorithms import ep, pvi
from fedppl.algorithms.trio import Trio
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.optimise import minimise

__all__ = ["METHODS", "TiltedLaplace", "make_trio", "consensus_draws"]

METHODS = ("laplace", "parametric", "consensus")


class TiltedLaplace(NamedTuple):
    """The Laplace approximation of ``cavity(theta) [p(y_k, z_k | theta) exp(share(theta))]^alpha``
    over the flat unconstrained ``(theta, z_k)``: ``steps`` L-BFGS steps from ``q``'s mean (local
    coordinates from 0), then the exact Hessian. Its moments carry no sampler diagnostics (NaN)
    and ``num_draws = 0``. ``prior_share`` as for :class:`~fedppl.algorithms.ep.TiltedNUTS`."""

    model: Callable
    guide: PVIGuide
    steps: int = 200
    prior_share: Callable[[Array], Array] | None = None
    max_rhat: float = float("inf")

    def moments(self, cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                rng_key: Array, alpha: float = 1.0, local: g.Conditional | None = None
                ) -> ep.TiltedMoments:
        D = self.guide.layout_or_raise().dim
        d = 0 if self.guide.local_layout is None else self.guide.local_layout.dim
        log_f = ep.log_factor(self.model, self.guide, data, mask, alpha, self.prior_share)

        def neg_log_density(phi: Array, _key=None) -> Array:
            return -(g.log_prob(cavity, phi[:D]) + log_f(phi))

        mean = g.to_moments(g.to_full(q))[0]
        start = jnp.concatenate([mean, jnp.zeros(d, mean.dtype)])
        mode = minimise(neg_log_density, start, optax.lbfgs(), self.steps,
                        line_search=True).params
        H = jax.hessian(neg_log_density)(mode)
        H = 0.5 * (H + H.T)
        prec, local = H[:D, :D], None
        if d:  # the marginal of theta: the Schur complement of the local block
            prec = prec - H[:D, D:] @ jnp.linalg.solve(H[D:, D:], H[D:, :D])
            local = g.Conditional(H[D:] @ mode, H[D:, D:], H[D:, :D])
        full = g.FullGaussian(prec @ mode[:D], prec)
        tilted = g.project_diag(full) if self.guide.diag else full
        nan = jnp.full((), jnp.nan, mean.dtype)
        return ep.TiltedMoments(tilted, nan, nan, nan, jnp.asarray(0), local)


def make_trio(solver: ep.TiltedSolver, prior: g.Gaussian, num_clients: int, *,
              max_divergence: float = pvi.MAX_DIVERGENCE) -> Trio:
    """The one-shot round as a :class:`~fedppl.algorithms.trio.Trio`: EP's client step against
    the fixed cavity ``prior^(1 / num_clients)`` from flat factors, undamped, and PVI's server
    (which sums the sites into ``q``)."""
    base = pvi.make_trio(cast(pvi.LocalSolver, solver), 1.0, prior,
                         max_divergence=max_divergence)
    share = g.scale(prior, 1.0 / num_clients)

    def client_step(server: pvi.ServerState, cstate: pvi.ClientState, data, mask, rng_key,
                    index):
        return ep.client_update(share, cstate, data, mask, rng_key, solver, 1.0)

    return base._replace(client_update=client_step)


def consensus_draws(draws: Array, rng_key: Array, num_draws: int | None = None) -> Array:
    """Consensus Monte Carlo's merge (numpyro's ``hmc_util.consensus``, full covariance weights)
    of the clients' subposterior draws ``(K, n, D)``: ``(num_draws or n, D)`` draws."""
    from numpyro.infer.hmc_util import consensus

    merged = consensus([{"theta": d} for d in draws], num_draws or draws.shape[1],
                       rng_key=rng_key)
    return cast(dict, merged)["theta"]
