"""pFed-Mul: federated multi-task GPs with Polya-Gamma CAVI on clients (Alg. 1-2, Eq. 5).

One round (``run_round``):

1. the server samples a fraction of the clients and sends them the global hyperparameters;
2. each sampled client overwrites the global groups of its personal copy of Theta, runs
   ``cavi_iters`` closed-form iterations ``q(omega) <- PG(1, sqrt(E f^2))``,
   ``q(u) <- N(m, S)`` (Eq. 3, App. C) from its previous ``q`` (warm start; prior at round 0),
   refreshes ``q(omega)`` once more, sets its *local* noise in closed form (Eq. 20) and takes
   ``local_steps`` Adam steps on its own ELBO for its other *local* hyperparameter groups;
3. it replies with a :class:`Message`: its ELBO value, the gradient of its ELBO w.r.t. Theta at
   the fixed ``q`` (zero outside the global groups) and, if the noise is global, the Eq. 20
   sufficient statistics ``(sum E[(y - f)^2], count)`` per task. No data, no inducing inputs;
4. the server drops non-finite messages, averages the accepted gradients with equal weights
   (the averaged ELBO of Eq. 5) and takes one Adam ascent step; a global noise is set in closed
   form from the pooled statistics (the maximiser of the averaged ELBO in ``sigma^2``).

Personalisation (Table 2): ``variant`` names the global groups -- "network" (deep-kernel MLP),
"kernel" (+ kernel phi), "kernel+W" (+ mixing weights), "all" (+ noise). ``fixed`` groups are never
trained. ``method="gaussian-vi"`` replaces CAVI by ``vi_steps`` Adam steps on a Monte Carlo ELBO
of the exact logistic likelihood with a full Gaussian ``q(u)``. pFed-St is the same algorithm
on one task at a time with ``num_latent=1`` and ``W = 1`` fixed (:func:`single_task_config`).

Example::

    >>> cfg = Config(spec=MOGPSpec(("regression", "classification")), variant="all")
    >>> server, clients = init(cfg, hyper0, datas, jax.random.PRNGKey(0))
    >>> for r in range(20):
    ...     server, clients, info = run_round(cfg, server, clients, datas, jax.random.PRNGKey(r))
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl.models import mogp
from fedppl.models.mogp import QU, Data, Hyper, MOGPSpec

__all__ = ["Config", "ClientState", "ServerState", "Message", "VARIANTS", "init", "init_client",
           "local_cavi", "client_update", "server_update", "sample_clients", "run_round", "run",
           "single_task_config", "task_data", "group_mask"]

VARIANTS = {"network": ("network",), "kernel": ("network", "kernel"),
            "kernel+W": ("network", "kernel", "W"), "all": ("network", "kernel", "W", "noise")}
_GROUP = {"net": "network", "log_phi0": "kernel", "log_phi1": "kernel", "W": "W",
          "log_noise": "noise"}


class Config(NamedTuple):
    spec: MOGPSpec
    method: str = "pfed-mul"          # "pfed-mul" | "gaussian-vi"
    variant: str = "all"              # key of VARIANTS
    fixed: tuple[str, ...] = ()       # groups never trained
    cavi_iters: int = 2
    server_lr: float = 0.01
    local_lr: float = 0.01
    local_steps: int = 1
    fraction: float = 1.0
    num_inducing: int = 20
    vi_steps: int = 2
    vi_lr: float = 0.05
    vi_samples: int = 8


class VIParams(NamedTuple):
    mean: Array
    tril: Array  # lower factor; diagonal stored as log


class ClientState(NamedTuple):
    Z: Array            # inducing inputs: stays on the client
    hyper: Hyper        # personal copy of Theta (global groups overwritten every round)
    q: QU
    c: Array            # q(omega_n) = PG(1, c_n)
    opt: Any            # Adam state of the local hyperparameter groups
    vi: VIParams        # Gaussian-VI parameters (unused by pFed-Mul)
    vi_opt: Any


class ServerState(NamedTuple):
    hyper: Hyper
    opt: Any
    round: int


class Message(NamedTuple):
    elbo: Array         # the client's ELBO at the fixed q
    grad: Hyper         # d ELBO / d Theta, zero outside the global groups
    noise_sum: Array    # (T,) sum E[(y - f)^2] per regression task (zeros if noise is local)
    noise_count: Array  # (T,)
    num_obs: Array


def group_mask(hyper: Hyper, groups: Sequence[str]) -> Hyper:
    """A pytree like ``hyper`` with 1.0 on the leaves whose group is in ``groups``, else 0.0."""
    parts = {name: jax.tree_util.tree_map(
        lambda x, on=_GROUP[name] in groups: jnp.full_like(x, float(on)), getattr(hyper, name))
        for name in Hyper._fields}
    return Hyper(**parts)


def _groups(config: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if config.variant not in VARIANTS:
        raise ValueError(f"unknown variant {config.variant!r}; choose from {list(VARIANTS)}")
    glob = VARIANTS[config.variant]
    local = tuple(g for g in ("network", "kernel", "W", "noise") if g not in glob)
    return glob, local


def _merge(mask: Hyper, a: Hyper, b: Hyper) -> Hyper:
    return jax.tree_util.tree_map(lambda m, x, y: jnp.where(m > 0, x, y), mask, a, b)


def _vi_q(spec: MOGPSpec, hyper: Hyper, Z: Array, vi: VIParams) -> QU:
    """Whitened parameterisation: ``u = L_K v``, ``q(v) = N(mean, R R^T)``."""
    R = jnp.tril(vi.tril, -1) + jnp.diag(jnp.exp(jnp.diag(vi.tril)))
    K, _ = mogp._kzz_chol(spec, hyper, mogp.mlp_apply(hyper.net, Z))
    Lk = jnp.linalg.cholesky(jax.scipy.linalg.block_diag(*K))
    LR = Lk @ R
    return QU(Lk @ vi.mean, LR @ LR.T)


def _mc_elbo(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU, key: Array,
             samples: int) -> Array:
    """Non-augmented ELBO: exact Gaussian term, Monte Carlo logistic term (reparameterised)."""
    m, v = mogp.marginals(spec, hyper, Z, data.X, data.task, q)
    f = m + jnp.sqrt(v) * jax.random.normal(key, (samples, m.shape[0]))
    cls = jnp.mean(jax.nn.log_sigmoid((2.0 * data.y - 1.0) * f), 0)
    s2 = jnp.exp(hyper.log_noise)[data.task]
    reg = -0.5 * jnp.log(2 * jnp.pi * s2) - (data.y**2 - 2 * data.y * m + m**2 + v) / (2 * s2)
    is_cls = jnp.asarray([k == "classification" for k in spec.kinds])[data.task]
    per = jnp.where(is_cls, cls, reg)
    return jnp.sum(jnp.where(data.mask, per, 0.0)) - mogp.kl_qu(spec, hyper, Z, q)


def local_cavi(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU, iters: int,
               trace: bool = False) -> tuple[QU, Array, list]:
    """``iters`` x (q(omega) update, q(u) update), then a final q(omega) update. With
    ``trace=True`` also returns the ELBO after every half-step (for monotonicity checks)."""
    elbos = []
    c = mogp.update_c(spec, hyper, Z, data, q)
    if not trace:
        def body(_, qc):
            q = mogp.cavi_qu(spec, hyper, Z, data, qc[1])
            return q, mogp.update_c(spec, hyper, Z, data, q)
        q, c = jax.lax.fori_loop(0, iters, body, (q, c))
        return q, c, elbos
    for _ in range(iters):
        if trace:
            elbos.append(mogp.elbo(spec, hyper, Z, data, q, c))
        q = mogp.cavi_qu(spec, hyper, Z, data, c)
        if trace:
            elbos.append(mogp.elbo(spec, hyper, Z, data, q, c))
        c = mogp.update_c(spec, hyper, Z, data, q)
    if trace:
        elbos.append(mogp.elbo(spec, hyper, Z, data, q, c))
    return q, c, elbos


def init_client(config: Config, hyper: Hyper, data: Data, key: Array) -> ClientState:
    """Inducing inputs from the client's own inputs, ``q(u)`` = prior, ``c = 0``."""
    Z = mogp.sample_inducing(key, data, config.num_inducing)
    q = mogp.prior_qu(config.spec, hyper, Z)
    vi = VIParams(jnp.zeros_like(q.mean), jnp.zeros_like(q.cov))
    return ClientState(Z, hyper, q, jnp.zeros(data.y.shape), optax.adam(config.local_lr).init(
        hyper), vi, optax.adam(config.vi_lr).init(vi))


def init(config: Config, hyper: Hyper, datas: Sequence[Data], key: Array
         ) -> tuple[ServerState, list[ClientState]]:
    _groups(config)
    keys = jax.random.split(key, len(datas))
    clients = [init_client(config, hyper, d, k) for d, k in zip(datas, keys)]
    return ServerState(hyper, optax.adam(config.server_lr).init(hyper), 0), clients


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
        raise ValueError(f"unknown method {config.method!r}")
    opt = optax.adam(config.vi_lr)

    def step(carry, k):
        vi, os = carry
        g = jax.grad(lambda p: -_mc_elbo(spec, hyper, st.Z, data,
                                         _vi_q(spec, hyper, st.Z, p), k, config.vi_samples))(vi)
        upd, os = opt.update(g, os, vi)
        return (optax.apply_updates(vi, upd), os), None

    (vi, vi_opt), _ = jax.lax.scan(step, (st.vi, st.vi_opt), jax.random.split(key,
                                                                             config.vi_steps))
    q = _vi_q(spec, hyper, st.Z, vi)
    return q, mogp.update_c(spec, hyper, st.Z, data, q), vi, vi_opt


def _client_update(config: Config, server_hyper: Hyper, st: ClientState, data: Data,
                   key: Array) -> tuple[ClientState, Message]:
    spec, (glob, local) = config.spec, _groups(config)
    hyper = _merge(group_mask(st.hyper, glob), server_hyper, st.hyper)
    kq, kh, km = jax.random.split(key, 3)
    q, c, vi, vi_opt = _fit_q(config, hyper, st, data, kq)
    sums, counts = mogp.noise_stats(spec, hyper, st.Z, data, q)
    if "noise" in local and "noise" not in config.fixed:
        hyper = hyper._replace(log_noise=jnp.where(
            counts > 0, jnp.log(jnp.maximum(sums, 1e-12) / jnp.maximum(counts, 1)),
            hyper.log_noise))
    train_local = [g for g in local if g not in config.fixed and g != "noise"]
    opt_state = st.opt
    if train_local and config.local_steps > 0:
        lmask, opt = group_mask(hyper, train_local), optax.adam(config.local_lr)
        for k in jax.random.split(kh, config.local_steps):
            g = jax.grad(_objective(config, st.Z, data, q, c, k))(hyper)
            g = jax.tree_util.tree_map(lambda a, m: -a * m, g, lmask)
            upd, opt_state = opt.update(g, opt_state, hyper)
            hyper = optax.apply_updates(hyper, upd)
    value, grad = jax.value_and_grad(_objective(config, st.Z, data, q, c, km))(hyper)
    gmask = group_mask(hyper, [g for g in glob if g not in config.fixed and g != "noise"])
    grad = jax.tree_util.tree_map(lambda a, m: a * m, grad, gmask)
    share_noise = "noise" in glob and "noise" not in config.fixed
    msg = Message(value, grad, sums * share_noise, counts * share_noise, jnp.sum(data.mask))
    return ClientState(st.Z, hyper, q, c, opt_state, vi, vi_opt), msg


_client_update_jit = jax.jit(_client_update, static_argnums=0)


def client_update(config: Config, server_hyper: Hyper, state: ClientState, data: Data,
                  key: Array) -> tuple[ClientState, Message]:
    """Local CAVI (or Gaussian VI) + local hyperparameters; returns the new state and message."""
    return _client_update_jit(config, server_hyper, state, data, key)


def _finite(tree: Any) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


def server_update(config: Config, state: ServerState, messages: Sequence[Message],
                  ids: Sequence[Any] | None = None) -> tuple[ServerState, dict]:
    """One Adam ascent step on the averaged ELBO (Eq. 5) from the accepted messages; global
    noise in closed form. Non-finite messages are rejected; with none accepted the state is
    returned unchanged."""
    ids = list(range(len(messages))) if ids is None else list(ids)
    ok = [i for i, m in enumerate(messages) if _finite(m)]
    info = {"accepted": [ids[i] for i in ok],
            "rejected": [ids[i] for i in range(len(messages)) if i not in ok]}
    if not ok:
        return state, info
    avg = jax.tree_util.tree_map(lambda *g: -sum(g) / len(g), *[messages[i].grad for i in ok])
    upd, opt = optax.adam(config.server_lr).update(avg, state.opt, state.hyper)
    hyper = optax.apply_updates(state.hyper, upd)
    glob, _ = _groups(config)
    if "noise" in glob and "noise" not in config.fixed:
        sums = sum(messages[i].noise_sum for i in ok)
        counts = sum(messages[i].noise_count for i in ok)
        hyper = hyper._replace(log_noise=jnp.where(
            counts > 0, jnp.log(jnp.maximum(sums, 1e-12) / jnp.maximum(counts, 1)),
            hyper.log_noise))
    info["elbo"] = float(np.mean([float(messages[i].elbo) for i in ok]))
    return ServerState(hyper, opt, state.round + 1), info


def sample_clients(key: Array, num_clients: int, fraction: float) -> list[int]:
    """``max(1, round(fraction * K))`` distinct clients, sorted."""
    k = max(1, int(round(fraction * num_clients)))
    return sorted(np.asarray(jax.random.choice(key, num_clients, (k,), replace=False)).tolist())


def run_round(config: Config, server: ServerState, clients: list[ClientState],
              datas: Sequence[Data], key: Array) -> tuple[ServerState, list[ClientState], dict]:
    """Sample clients, update them, aggregate; unsampled clients keep their state."""
    ks, kc = jax.random.split(key)
    chosen = sample_clients(ks, len(clients), config.fraction)
    clients, msgs = list(clients), []
    for i, k in zip(chosen, jax.random.split(kc, len(chosen))):
        new, msg = client_update(config, server.hyper, clients[i], datas[i], k)
        msgs.append(msg)
        if _finite(msg):
            clients[i] = new
    server, info = server_update(config, server, msgs, chosen)
    return server, clients, info


def run(config: Config, hyper: Hyper, datas: Sequence[Data], rounds: int, key: Array,
        callback: Callable[[int, ServerState, list[ClientState]], dict] | None = None
        ) -> tuple[ServerState, list[ClientState], list[dict]]:
    """``rounds`` rounds; ``callback(round, server, clients)`` may add metrics to the history."""
    k0, key = jax.random.split(key)
    server, clients = init(config, hyper, datas, k0)
    history = []
    for r, k in enumerate(jax.random.split(key, rounds)):
        t0 = time.perf_counter()
        server, clients, info = run_round(config, server, clients, datas, k)
        jax.block_until_ready(server.hyper)
        info["seconds"] = time.perf_counter() - t0
        if callback is not None:
            info.update(callback(r, server, clients))
        history.append(info)
    return server, clients, history


def task_data(data: Data, task: int) -> Data | None:
    """The rows of one task, relabelled as task 0 (``None`` if the client has none)."""
    keep = np.flatnonzero(np.asarray(data.mask) & (np.asarray(data.task) == task))
    if len(keep) == 0:
        return None
    return Data(data.X[keep], data.y[keep], jnp.zeros(len(keep), jnp.int32),
                jnp.ones(len(keep), bool))


def single_task_config(config: Config, task: int) -> Config:
    """pFed-St for one task: one latent GP, ``W = 1`` fixed, same rest of the configuration."""
    spec = config.spec._replace(kinds=(config.spec.kinds[task],), num_latent=1)
    return config._replace(spec=spec, fixed=tuple(sorted(set(config.fixed) | {"W"})))
