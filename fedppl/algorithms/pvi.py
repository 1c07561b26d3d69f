"""Partitioned variational inference as pure functions (Ashman et al. 2022; Sec. 3 of the
federated sparse GP paper).

The server holds ``q = p * prod_k t_k``; client ``k`` holds its factor ``t_k``. One client step:

1. cavity ``q_{\\k} = q / t_k`` (repaired if not positive definite, and flagged);
2. ``q_k = argmax_q E_q[log p(y_k | theta)] - KL(q || q_{\\k})`` by a :class:`LocalSolver`;
3. new factor ``t_k' = (q_k / q_{\\k})^rho * t_k^(1 - rho)`` (damping ``rho``);
4. the message is ``delta_k = t_k' / t_k``: the only thing that leaves the client.

The server multiplies the deltas it accepts into ``q``: non-finite deltas are rejected, and if the
new ``q`` would not be positive definite the step is halved (up to ten times, then dropped). The
accepted step is acknowledged to the client, which applies the same step to its own factor, so
``q = p * prod_k t_k`` holds exactly on both sides.

Example (what :class:`fedppl.PVI` does each synchronous round)::

    >>> msgs, _ = jax.vmap(client_update, (None, 0, 0, 0, 0, None, None))(
    ...     state.q, factors, data, masks, keys, solver, damping)
    >>> state, steps = server_update(state, msgs)
    >>> factors = acknowledge(factors, msgs, steps)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax
from jax import Array
from numpyro import handlers
from numpyro.infer import Trace_ELBO

from fedppl.algorithms import conjugate
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.cavity import cavity
from fedppl.handlers.client import client

__all__ = [
    "ServerState", "ClientMessage", "LocalSolver", "VariationalSolver", "ConjugateSolver",
    "init", "client_update", "server_update", "acknowledge", "observed_log_lik",
]

STEP_SIZES = tuple(2.0**-i for i in range(11))


class ServerState(NamedTuple):
    q: g.Gaussian
    round: Array


class ClientMessage(NamedTuple):
    """What client k sends up: its factor update and diagnostics (no data)."""

    delta: g.Gaussian
    free_energy: Array
    cavity_repaired: Array


class LocalSolver(Protocol):
    """Maximises client k's local free energy: ``(cavity, q, data, mask, key) -> (q_k, F_k)``."""

    def __call__(self, q_cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                 rng_key: Array) -> tuple[g.Gaussian, Array]: ...


class VariationalSolver(NamedTuple):
    """Stochastic maximisation of the ELBO of ``cavity(client(model))`` under the guide.

    Starts from the current ``q`` and runs ``steps`` optax updates under ``lax.scan``; returns the
    optimised q and a final free-energy estimate.
    """

    model: Callable
    guide: PVIGuide
    optimizer: optax.GradientTransformation
    steps: int
    num_particles: int = 8

    def __call__(self, q_cavity, q, data, mask, rng_key):
        elbo = Trace_ELBO(num_particles=self.num_particles)
        local_model = cavity(client(self.model, mask=mask), q_cavity=q_cavity,
                             layout=self.guide.layout)

        def loss(params, key):
            return elbo.loss(key, params, local_model, self.guide, *data)

        def step(carry, key):
            params, opt_state = carry
            value, grads = jax.value_and_grad(loss)(params, key)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        params = self.guide.params_from(q)
        keys = jax.random.split(rng_key, self.steps + 1)
        (params, _), _ = jax.lax.scan(step, (params, self.optimizer.init(params)), keys[1:])
        return self.guide.q_from(params), -loss(params, keys[0])


class ConjugateSolver(NamedTuple):
    """Closed-form maximiser for a Gaussian likelihood affine in the global sites."""

    model: Callable
    guide: PVIGuide

    def __call__(self, q_cavity, q, data, mask, rng_key):
        lik = conjugate.likelihood_terms(client(self.model, mask=mask), self.guide.layout, *data)
        cav_full = g.to_full(q_cavity)
        target = g.product(cav_full, conjugate.likelihood_factor(lik))
        q_new = g.project_diag(target) if self.guide.diag else target
        mean, cov = g.to_moments(g.to_full(q_new))
        free_energy = conjugate.expected_log_lik(lik, mean, cov) - g.kl(q_new, q_cavity)
        return q_new, free_energy


# -- the trio ------------------------------------------------------------------------------------


def init(prior: g.Gaussian, factors: g.Gaussian) -> ServerState:
    """Server state for ``q = prior * prod_k factors[k]`` (factors stacked on axis 0)."""
    total = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), factors)
    return ServerState(g.product(prior, total), jnp.asarray(0))


def client_update(q: g.Gaussian, factor: g.Gaussian, data: tuple, mask: Array, rng_key: Array,
                  solver: LocalSolver, damping: float | Array) -> tuple[ClientMessage, g.Gaussian]:
    """One PVI step on one client; returns the message and the client's proposed new factor."""
    q_cav, repaired = g.repair(g.quotient(q, factor))
    q_k, free_energy = solver(q_cav, q, data, mask, rng_key)
    new_factor = g.damp(factor, g.quotient(q_k, q_cav), damping)
    return ClientMessage(g.quotient(new_factor, factor), free_energy, repaired), new_factor


def server_update(state: ServerState, messages: ClientMessage, received: Array | None = None
                  ) -> tuple[ServerState, Array]:
    """Apply the finite deltas (stacked on axis 0), halving the step while q is not PD.

    ``received`` (booleans, one per message) marks the clients that replied this round; the
    others' slots are ignored. Returns the new state and the step each client's delta was applied
    with (0 = not applied).
    """
    ok = g.is_finite(messages.delta)
    if received is not None:
        ok = ok & received
    clean = jax.tree_util.tree_map(
        lambda d: jnp.where(ok.reshape(ok.shape + (1,) * (d.ndim - 1)), d, 0.0), messages.delta
    )
    total = jax.tree_util.tree_map(lambda d: jnp.sum(d, axis=0), clean)
    sizes = jnp.asarray(STEP_SIZES, dtype=total.nat1.dtype)
    candidates = jax.vmap(lambda s: g.product(state.q, g.scale(total, s)))(sizes)
    pd = g.is_pd(candidates)
    step = jnp.where(jnp.any(pd), sizes[jnp.argmax(pd)], 0.0)
    q = g.product(state.q, g.scale(total, step))
    return ServerState(q, state.round + 1), jnp.where(ok, step, 0.0)


def acknowledge(factors: g.Gaussian, messages: ClientMessage, steps: Array) -> g.Gaussian:
    """Clients apply their delta with the step the server accepted (stacked on axis 0)."""

    def apply(t, d):
        s = steps.reshape(steps.shape + (1,) * (d.ndim - 1))
        return t + jnp.where(s > 0, s * d, 0.0)

    return jax.tree_util.tree_map(apply, factors, messages.delta)


# -- evaluation ----------------------------------------------------------------------------------


def observed_log_lik(model: Callable, values: dict[str, Array], *args: Any, **kwargs: Any
                     ) -> Array:
    """Sum of the (masked, scaled) log densities of the observed sites at the given values."""
    tr = handlers.trace(handlers.substitute(handlers.seed(model, 0), data=values)).get_trace(
        *args, **kwargs
    )
    total = 0.0
    for site in tr.values():
        if site["type"] == "sample" and site["is_observed"]:
            lp = jnp.sum(site["fn"].log_prob(site["value"]))
            total = total + (lp if site["scale"] is None else site["scale"] * lp)
    return total
