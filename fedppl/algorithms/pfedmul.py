"""pFed-Mul as a trio: federated multi-task GPs with Polya-Gamma CAVI on the clients (Alg. 1-2).

The front is :class:`fedppl.infer.multitask_gp.PFedMul`; this module holds the pure pieces the
embedded runtime drives (:func:`make_trio`), one round of which is:

1. the server broadcasts the global hyperparameter groups of Theta (:class:`ServerState`);
2. each client taking part overwrites the global groups of its personal copy of Theta, runs
   ``cavi_iters`` closed-form sweeps ``q(omega) <- PG(1, sqrt(E f^2))``, ``q(u) <- N(m, S)``
   (Eq. 3, App. C) from its previous ``q`` (warm start; the prior at the first round), refreshes
   ``q(omega)`` once more, sets a *local* noise in closed form (Eq. 20) and takes ``local_steps``
   steps of its optimiser on its own ELBO for its other *local* groups;
3. it sends a :class:`Message`: its ELBO, the gradient of its ELBO w.r.t. Theta at the fixed
   ``q`` (zero outside the global groups) and, if the noise is global, the Eq. 20 sufficient
   statistics ``(sum E[(y - f)^2], count)`` per task. No data and no inducing inputs leave it;
4. the server drops non-finite messages, averages the accepted gradients with equal weights
   (the averaged ELBO of Eq. 5) and takes one step of its optimiser uphill; a global noise is
   set in closed form from the pooled statistics. Its reply to each client is whether it
   accepted the message; a client whose message was refused (or that sat the round out) keeps
   its previous state.

Personalisation (Table 2): ``variant`` names the global groups -- "network" (deep-kernel MLP),
"kernel" (+ kernel phi), "kernel+W" (+ mixing weights), "all" (+ noise); ``fixed`` groups are never
trained. ``method="gaussian-vi"`` replaces CAVI by ``vi_steps`` optimiser steps on a Monte Carlo
ELBO of the exact logistic likelihood with a full Gaussian ``q(u)``. pFed-St is the same
algorithm on one task at a time with ``num_latent=1`` and ``W = 1`` fixed
(:func:`single_task_config`).

Example (two clients, one synchronous round by hand)::

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> spec = mogp.MOGPSpec(("regression", "classification"), num_latent=1)
    >>> hyper = mogp.init_hyper(spec, 1, W=jnp.ones((2, 1)))
    >>> X = jnp.linspace(0.0, 5.0, 8)[:, None]
    >>> data = (jnp.stack([X, X]), jnp.asarray([[0.1, 0.3, 0.2, 0.5, 1, 0, 1, 1.0]] * 2),
    ...         jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1]] * 2))
    >>> masks = jnp.ones((2, 8), bool)
    >>> config = Config(spec)
    >>> server, clients = init_server(config, hyper), init_clients(config, hyper, data[0][:, :4], 8)
    >>> trio = make_trio(config)
    >>> msgs, proposed = jax.vmap(trio.client_update, (None, 0, 0, 0, 0, 0))(
    ...     server, clients, data, masks, jax.random.split(jax.random.PRNGKey(0), 2), jnp.arange(2))
    >>> server, accepted = trio.server_update(server, msgs, jnp.arange(2), jnp.ones(2, bool), None,
    ...                                       None)
    >>> np.asarray(accepted).tolist(), msgs.elbo.shape
    ([True, True], (2,))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import trees
from fedppl.algorithms.fedavg import all_finite
from fedppl.algorithms.trio import Trio
from fedppl.models import mogp
from fedppl.models.mogp import QU, Data, Hyper, MOGPSpec
from fedppl.optimise import minimise

__all__ = ["Config", "ClientState", "ServerState", "Message", "VIParams", "VARIANTS", "GROUPS",
           "METHODS", "make_trio", "init_server", "init_clients", "local_cavi", "client_step",
           "server_step", "sample_clients", "round_keys", "single_task_config", "group_mask",
           "groups"]

VARIANTS = {"network": ("network",), "kernel": ("network", "kernel"),
            "kernel+W": ("network", "kernel", "W"), "all": ("network", "kernel", "W", "noise")}
GROUPS = ("network", "kernel", "W", "noise")
METHODS = ("pfed-mul", "gaussian-vi")
_GROUP = {"net": "network", "log_phi0": "kernel", "log_phi1": "kernel", "W": "W",
          "log_noise": "noise"}


class Config(NamedTuple):
    """The algorithm's static settings (hashable: the trio is compiled once per config).

    ``optimizer`` takes the clients' local hyperparameter steps, ``server_optimizer`` the
    server's ascent step on the averaged ELBO, ``vi_optimizer`` the Gaussian-VI steps on q(u).
    """

    spec: MOGPSpec
    method: str = "pfed-mul"
    variant: str = "all"
    fixed: tuple[str, ...] = ()
    cavi_iters: int = 2
    local_steps: int = 1
    vi_steps: int = 2
    vi_samples: int = 8
    optimizer: optax.GradientTransformation = optax.adam(1e-2)
    server_optimizer: optax.GradientTransformation = optax.adam(1e-2)
    vi_optimizer: optax.GradientTransformation = optax.adam(5e-2)


class VIParams(NamedTuple):
    mean: Array
    tril: Array  # lower factor; diagonal stored as log


class ClientState(NamedTuple):
    """What a client keeps between rounds (stacked on the client axis by the runtime)."""

    Z: Array            # inducing inputs: never leave the client
    hyper: Hyper        # personal copy of Theta (global groups overwritten every round)
    q: QU
    c: Array            # q(omega_n) = PG(1, c_n), one per (padded) row
    opt: Any            # optimiser state of the local hyperparameter groups
    vi: VIParams        # Gaussian-VI parameters (unused by pFed-Mul)
    vi_opt: Any


class ServerState(NamedTuple):
    hyper: Hyper        # the global Theta (only its global groups matter to the clients)
    opt: Any            # the server optimiser's state


class Message(NamedTuple):
    """All that leaves a client in a round: O(#hyperparameters) numbers."""

    elbo: Array         # the client's ELBO at the fixed q
    grad: Hyper         # d ELBO / d Theta, zero outside the global groups
    noise_sum: Array    # (T,) sum E[(y - f)^2] per regression task (zeros if noise is local)
    noise_count: Array  # (T,)
    num_obs: Array


# -- hyperparameter groups ----------------------------------------------------------------------


def group_mask(hyper: Hyper, names: Sequence[str]) -> Hyper:
    """A pytree like ``hyper`` with 1.0 on the leaves whose group is in ``names``, else 0.0."""
    parts = {name: jax.tree_util.tree_map(
        lambda x, on=_GROUP[name] in names: jnp.full_like(x, float(on)), getattr(hyper, name))
        for name in Hyper._fields}
    return Hyper(**parts)


def groups(config: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(global, local)`` hyperparameter groups of the config's variant."""
    if config.variant not in VARIANTS:
        raise ValueError(f"unknown variant {config.variant!r}; choose from {list(VARIANTS)}")
    glob = VARIANTS[config.variant]
    return glob, tuple(g for g in GROUPS if g not in glob)


def _merge(mask: Hyper, a: Hyper, b: Hyper) -> Hyper:
    return jax.tree_util.tree_map(lambda m, x, y: jnp.where(m > 0, x, y), mask, a, b)


def _closed_form_noise(sums: Array, counts: Array, log_noise: Array) -> Array:
    """Eq. 20: ``log(sum / count)`` per task with regression rows, else unchanged."""
    return jnp.where(counts > 0, jnp.log(jnp.maximum(sums, 1e-12) / jnp.maximum(counts, 1)),
                     log_noise)


# -- the client's local problem -----------------------------------------------------------------


def _vi_q(spec: MOGPSpec, hyper: Hyper, Z: Array, vi: VIParams) -> QU:
    """Whitened parameterisation: ``u = L_K v``, ``q(v) = N(mean, R R^T)``."""
    R = jnp.tril(vi.tril, -1) + jnp.diag(jnp.exp(jnp.diag(vi.tril)))
    K, _ = mogp.kzz_chol(spec, hyper, mogp.features(hyper, Z))
    Lk = jnp.linalg.cholesky(jax.scipy.linalg.block_diag(*K))
    LR = Lk @ R
    return QU(Lk @ vi.mean, LR @ LR.T)


def _row_normals(key: Array, samples: int, mask: Array) -> Array:
    """Standard normal draws ``(samples, N)``. On the real rows (the first ``sum(mask)``;
    padding comes last) they are exactly the draw ``normal(key, (samples, N_k))`` of the
    unpadded client, so a client's draws do not depend on how far it was padded."""
    n_real = jnp.sum(mask)
    flat = jax.random.normal(key, (samples * mask.shape[0],))
    rows = jnp.minimum(jnp.arange(mask.shape[0]), n_real - 1)
    return flat[jnp.arange(samples)[:, None] * n_real + rows[None, :]]


def _mc_elbo(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU, key: Array,
             samples: int) -> Array:
    """Non-augmented ELBO: exact Gaussian term, Monte Carlo logistic term (reparameterised)."""
    m, v = mogp.marginals(spec, hyper, Z, data.X, data.task, q)
    f = m + jnp.sqrt(v) * _row_normals(key, samples, data.mask)
    cls = jnp.mean(jax.nn.log_sigmoid((2.0 * data.y - 1.0) * f), 0)
    s2 = jnp.exp(hyper.log_noise)[data.task]
    reg = -0.5 * jnp.log(2 * jnp.pi * s2) - (data.y**2 - 2 * data.y * m + m**2 + v) / (2 * s2)
    is_cls = jnp.asarray([k == "classification" for k in spec.kinds])[data.task]
    per = jnp.where(is_cls, cls, reg)
    return jnp.sum(jnp.where(data.mask, per, 0.0)) - mogp.kl_qu(spec, hyper, Z, q)


def local_cavi(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU, iters: int,
               trace: bool = False) -> tuple[QU, Array, list]:
    """``iters`` x (q(omega) update, q(u) update), then a final q(omega) update. With
    ``trace=True`` (eager) also returns the ELBO after every half-step (monotonicity checks)."""
    c = mogp.update_c(spec, hyper, Z, data, q)
    if not trace:
        def body(_, qc):
            q = mogp.cavi_qu(spec, hyper, Z, data, qc[1])
            return q, mogp.update_c(spec, hyper, Z, data, q)
        q, c = jax.lax.fori_loop(0, iters, body, (q, c))
        return q, c, []
    elbos = []
    for _ in range(iters):
        elbos.append(mogp.elbo(spec, hyper, Z, data, q, c))
        q = mogp.cavi_qu(spec, hyper, Z, data, c)
        elbos.append(mogp.elbo(spec, hyper, Z, data, q, c))
        c = mogp.update_c(spec, hyper, Z, data, q)
    elbos.append(mogp.elbo(spec, hyper, Z, data, q, c))
    return q, c, elbos


def _descend(loss: Callable[[Any, Array], Array], params: Any,
             optimizer: optax.GradientTransformation, keys: Array, opt_state: Any
             ) -> tuple[Any, Any]:
    """Steps of ``optimizer`` on ``loss(params, key)``, one per key, continuing ``opt_state``;
    returns the parameters and the optimiser state (carried to the next round)."""
    params, _, opt_state = minimise(loss, params, optimizer, keys=keys, opt_state=opt_state)
    return params, opt_state


def _objective(config: Config, Z: Array, data: Data, q: QU, c: Array, key: Array
               ) -> Callable[[Hyper], Array]:
    if config.method == "gaussian-vi":
        return lambda h: _mc_elbo(config.spec, h, Z, data, q, key, config.vi_samples)
    return lambda h: mogp.elbo(config.spec, h, Z, data, q, c)


def _fit_q(config: Config, hyper: Hyper, st: ClientState, data: Data, key: Array
           ) -> tuple[QU, Array, VIParams, Any]:
    spec = config.spec
    if config.method == "pfed-mul":
        q, c, _ = local_cavi(spec, hyper, st.Z, data, st.q, config.cavi_iters)
        return q, c, st.vi, st.vi_opt
    if config.method != "gaussian-vi":
        raise ValueError(f"unknown method {config.method!r}; choose from {METHODS}")

    def loss(vi: VIParams, k: Array) -> Array:
        return -_mc_elbo(spec, hyper, st.Z, data, _vi_q(spec, hyper, st.Z, vi), k,
                         config.vi_samples)

    vi, vi_opt = _descend(loss, st.vi, config.vi_optimizer,
                          jax.random.split(key, config.vi_steps), st.vi_opt)
    q = _vi_q(spec, hyper, st.Z, vi)
    return q, mogp.update_c(spec, hyper, st.Z, data, q), vi, vi_opt


def _local_steps(config: Config, hyper: Hyper, st: ClientState, data: Data, q: QU, c: Array,
                 key: Array, local: tuple[str, ...]) -> tuple[Hyper, Any]:
    """``local_steps`` optimiser steps on the client's ELBO for its trainable local groups."""
    train = [g for g in local if g not in config.fixed and g != "noise"]
    if not train or config.local_steps == 0:
        return hyper, st.opt
    lmask = group_mask(hyper, train)

    def loss(h: Hyper, k: Array) -> Array:
        h = _merge(lmask, h, jax.lax.stop_gradient(h))  # gradient only in the local groups
        return -_objective(config, st.Z, data, q, c, k)(h)

    return _descend(loss, hyper, config.optimizer, jax.random.split(key, config.local_steps),
                    st.opt)


def client_step(config: Config, server_hyper: Hyper, st: ClientState, data: Data, key: Array
                ) -> tuple[ClientState, Message]:
    """Local CAVI (or Gaussian VI) and local hyperparameters; the new state and the message."""
    spec, (glob, local) = config.spec, groups(config)
    hyper = _merge(group_mask(st.hyper, glob), server_hyper, st.hyper)
    kq, kh, km = jax.random.split(key, 3)
    q, c, vi, vi_opt = _fit_q(config, hyper, st, data, kq)
    sums, counts = mogp.noise_stats(spec, hyper, st.Z, data, q)
    if "noise" in local and "noise" not in config.fixed:
        hyper = hyper._replace(log_noise=_closed_form_noise(sums, counts, hyper.log_noise))
    hyper, opt_state = _local_steps(config, hyper, st, data, q, c, kh, local)
    value, grad = jax.value_and_grad(_objective(config, st.Z, data, q, c, km))(hyper)
    gmask = group_mask(hyper, [g for g in glob if g not in config.fixed and g != "noise"])
    grad = jax.tree_util.tree_map(lambda a, m: a * m, grad, gmask)
    share_noise = "noise" in glob and "noise" not in config.fixed
    msg = Message(value, grad, sums * share_noise, counts * share_noise, jnp.sum(data.mask))
    return ClientState(st.Z, hyper, q, c, opt_state, vi, vi_opt), msg


# -- the server ----------------------------------------------------------------------------------


def _sum_accepted(x: Array, ok: Array) -> Array:
    return jnp.sum(jnp.where(ok.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0), axis=0)


def server_step(config: Config, server: ServerState, msgs: Message, ok: Array) -> ServerState:
    """One optimiser step uphill on the averaged ELBO (Eq. 5) from the accepted messages
    (``ok``, stacked on axis 0); a global noise in closed form. Unchanged if none is accepted."""
    n = jnp.sum(ok)
    avg = jax.tree_util.tree_map(lambda g: -_sum_accepted(g, ok) / jnp.maximum(n, 1), msgs.grad)
    upd, opt = config.server_optimizer.update(avg, server.opt, server.hyper)
    hyper = optax.apply_updates(server.hyper, upd)
    glob, _ = groups(config)
    if "noise" in glob and "noise" not in config.fixed:
        hyper = hyper._replace(log_noise=_closed_form_noise(
            _sum_accepted(msgs.noise_sum, ok), _sum_accepted(msgs.noise_count, ok),
            hyper.log_noise))
    new = ServerState(hyper, opt)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(n > 0, a, b), new, server)


def make_trio(config: Config) -> Trio:
    """pFed-Mul's client step, server step and acknowledgement for :func:`make_round`.

    The data of a client are ``(X, y, task)`` padded to a common number of rows, with its mask.
    """
    groups(config)

    def client_update(server, client, data, mask, rng_key, index):
        X, y, task = data
        new, msg = client_step(config, server.hyper, client, Data(X, y, task, mask), rng_key)
        return msg, new

    def server_update(server, msgs, index, received, rng_key, evaluate):
        ok = jnp.asarray(received) & all_finite(msgs)
        return server_step(config, server, msgs, ok), ok

    def acknowledge(client, msg, accepted, proposed):
        return jax.tree_util.tree_map(lambda p, c: jnp.where(accepted, p, c), proposed, client)

    return Trio(client_update, server_update, acknowledge)


# -- initial states --------------------------------------------------------------------------


def init_server(config: Config, hyper: Hyper) -> ServerState:
    return ServerState(hyper, config.server_optimizer.init(hyper))


def init_clients(config: Config, hyper: Hyper, Z: Array, num_rows: int | None = None
                 ) -> ClientState:
    """Stacked client states from inducing inputs ``Z (K, M, D)``: personal Theta = ``hyper``,
    ``q(u)`` = the prior, ``c = 0`` on ``num_rows`` (padded) rows (default ``M``)."""
    K = Z.shape[0]
    q = jax.vmap(lambda z: mogp.prior_qu(config.spec, hyper, z))(Z)
    vi = VIParams(jnp.zeros_like(q.mean), jnp.zeros_like(q.cov))
    opt = trees.broadcast(config.optimizer.init(hyper), K)
    vi_opt = jax.vmap(config.vi_optimizer.init)(vi)
    n = Z.shape[1] if num_rows is None else num_rows
    return ClientState(Z, trees.broadcast(hyper, K), q, jnp.zeros((K, n), Z.dtype), opt, vi,
                       vi_opt)


# -- who takes part, with which keys -------------------------------------------------------------


def sample_clients(key: Array, num_clients: int, fraction: float) -> list[int]:
    """``max(1, round(fraction * K))`` distinct clients, sorted."""
    k = max(1, round(fraction * num_clients))
    return sorted(np.asarray(jax.random.choice(key, num_clients, (k,), replace=False)).tolist())


def round_keys(key: Array, round_index: int, num_clients: int, fraction: float
               ) -> tuple[Array, np.ndarray]:
    """Client keys ``(K, ...)`` and the taking-part mask of round ``round_index`` (from 0).

    Round ``r`` uses ``split(key, R)[r]`` (independent of ``R`` under jax's partitionable
    threefry): half of it samples the clients, the other half is split among them in order.
    """
    k = jax.random.split(key, round_index + 1)[round_index]
    ks, kc = jax.random.split(k)
    chosen = sample_clients(ks, num_clients, fraction)
    rest = [i for i in range(num_clients) if i not in chosen]
    keys = jax.random.split(kc, len(chosen))
    if rest:  # clients outside the round get keys of their own (they send nothing)
        keys = jnp.concatenate([keys, jax.random.split(jax.random.fold_in(kc, 1), len(rest))])
    order = np.empty(num_clients, int)
    order[chosen] = np.arange(len(chosen))
    order[rest] = len(chosen) + np.arange(len(rest))
    active = np.zeros(num_clients, bool)
    active[chosen] = True
    return keys[order], active


def single_task_config(config: Config, task: int) -> Config:
    """pFed-St for one task: one latent GP, ``W = 1`` fixed, same rest of the configuration."""
    spec = config.spec._replace(kinds=(config.spec.kinds[task],), num_latent=1)
    return config._replace(spec=spec, fixed=tuple(sorted(set(config.fixed) | {"W"})))
