"""Front end for federated sparse GPs: PVI with an HVM over inducing locations, and baselines.

Methods: ``"dpo"`` / ``"cpo"`` (PVI with q(Z), decoupled or coupled pseudo-observations),
``"fedavg-z"`` (Alg. 1: point Z averaged by the server), ``"fixed"`` (Z fixed at a N(0, I) draw)
and ``"global"`` (centralised SVGP on the pooled data: Z a point initialised at random training
inputs; for a Gaussian likelihood q(u) is Titsias' optimum, for Bernoulli a free Gaussian).

Example::

    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=10)
    >>> res = fit_sgp("dpo", clients, num_rounds=30, config=SGPConfig(num_inducing=50))
    >>> mean, var = res.predict(X_test)
    >>> res.log_likelihood(X_test, y_test_original, y_mean=s.y_mean, y_std=s.y_std)
    >>> rounds_to_convergence(res.history, tol=1.0)
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.scipy.special import logsumexp

from fedppl import metrics
from fedppl.algorithms import sgp_pvi
from fedppl.clients import Clients
from fedppl.guides import sgp_guide as sg

__all__ = ["SGPConfig", "SGPResult", "METHODS", "fit_sgp", "rounds_to_convergence"]

METHODS = ("dpo", "cpo", "fedavg-z", "fixed", "global")


class SGPConfig(NamedTuple):
    num_inducing: int = 100
    pseudo_fraction: float = 0.8
    max_pseudo: int = 500
    alpha: float = 0.1
    learning_rate: float = 1e-2
    local_steps: int = 200
    schedule: str = "sequential"   # or "synchronous"
    damping: float = 1.0
    num_samples: int = 1           # MC samples of (beta, Z) per step
    inner_steps: int = 200         # J for fedavg-z
    init_precision: float = 100.0
    covariance: str = "diag"       # DPO S_k: diag | full
    likelihood: str = "gaussian"   # or "bernoulli"
    fixed_hyper: dict | None = None
    fixed_inducing: Array | None = None
    pseudo_init: str = "data"      # V_k from the client's inputs ("data") or N(0, I) ("prior")


@dataclass
class SGPResult:
    method: str
    state: sgp_pvi.SGPState
    history: dict
    spec: sgp_pvi.Spec

    def _samples(self, X, key, num_samples):
        key = jax.random.PRNGKey(1) if key is None else key
        return _predict_jit(self.spec, self.state, jnp.asarray(X, float), key, num_samples)

    def predict(self, X, key=None, num_samples: int = 100) -> tuple[Array, Array]:
        """Mixture mean and variance of y (Gaussian likelihood) or of f (Bernoulli)."""
        mu, var, noise = self._samples(X, key, num_samples)
        extra = noise[:, None] if self.spec.likelihood == "gaussian" else 0.0
        mean = mu.mean(0)
        return mean, jnp.mean(var + extra + mu**2, 0) - mean**2

    def predict_f(self, X, key=None, num_samples: int = 100) -> tuple[Array, Array]:
        mu, var, _ = self._samples(X, key, num_samples)
        mean = mu.mean(0)
        return mean, jnp.mean(var + mu**2, 0) - mean**2

    def predict_proba(self, X, key=None, num_samples: int = 100) -> Array:
        """P(y = 1) for the Bernoulli likelihood (Gauss-Hermite over f, averaged over samples)."""
        mu, var, _ = self._samples(X, key, num_samples)
        gx, gw = np.polynomial.hermite_e.hermegauss(32)
        f = mu[..., None] + jnp.sqrt(var)[..., None] * gx
        return jnp.mean(jax.nn.sigmoid(f) @ (gw / np.sqrt(2 * np.pi)), 0)

    def inducing(self) -> tuple[Array, Array]:
        """Mean and standard deviation of q(Z) (zeros for point estimates)."""
        if self.spec.z_mode != "hvm":
            return self.state.z_point, jnp.zeros_like(self.state.z_point)
        mean, var = sgp_pvi.to_moments(sgp_pvi._q(self.state.z_prior, self.state.t_z))
        return mean, jnp.sqrt(var)

    def log_likelihood(self, X, y, key=None, num_samples: int = 100, y_mean: float = 0.0,
                       y_std: float = 1.0) -> float:
        """Average test log-likelihood in original units: log-mean-exp over the (beta, Z) samples
        of N(y_std_scaled; mu_s, var_s + noise_s), minus log(y_std) (Jacobian). Gaussian only."""
        if self.spec.likelihood != "gaussian":
            raise ValueError("log_likelihood is for the Gaussian likelihood; use predict_proba")
        mu, var, noise = self._samples(X, key, num_samples)
        ys = (jnp.asarray(y, float) - y_mean) / y_std
        v = var + noise[:, None]
        logp = -0.5 * (jnp.log(2 * jnp.pi * v) + (ys - mu) ** 2 / v)
        return float(jnp.mean(logsumexp(logp, 0) - np.log(num_samples)) - np.log(y_std))

    def rmse(self, X, y, key=None, num_samples: int = 100, y_mean: float = 0.0,
             y_std: float = 1.0) -> float:
        mean, _ = self.predict(X, key, num_samples)
        return float(jnp.sqrt(jnp.mean((mean * y_std + y_mean - jnp.asarray(y, float)) ** 2)))


@partial(jax.jit, static_argnums=(0, 4))
def _predict_jit(spec, state, X, key, num):
    return sgp_pvi.predictive_samples(spec, state, X, key, num)


def rounds_to_convergence(history: dict, tol: float, key: str = "free_energy") -> int:
    """First round after which ``history[key]`` stays within ``tol`` of its final value."""
    if len(history[key]) == 0:
        raise ValueError("empty history")
    return int(history["round"][metrics.rounds_to_convergence(history[key], tol) - 1])


# -- validation and set-up -------------------------------------------------------------------------


def _check(method: str, clients: Clients, config: SGPConfig) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for name, value, allowed in (("schedule", config.schedule, ("sequential", "synchronous")),
                                 ("covariance", config.covariance, ("diag", "full")),
                                 ("likelihood", config.likelihood, ("gaussian", "bernoulli")),
                                 ("pseudo_init", config.pseudo_init, ("data", "prior"))):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if not 0 < config.pseudo_fraction <= 1:
        raise ValueError(f"pseudo_fraction must be in (0, 1] (M_k <= N_k), got "
                         f"{config.pseudo_fraction}")
    if not 0 < config.damping <= 1 or config.alpha < 0 or config.num_inducing < 1:
        raise ValueError("need 0 < damping <= 1, alpha >= 0 and num_inducing >= 1")
    for k, arrays in enumerate(clients.data):
        who = clients.names[k]
        if len(arrays) != 2 or np.ndim(arrays[0]) != 2 or np.ndim(arrays[1]) != 1:
            raise ValueError(f"{who}: need (X of shape (N, D), y of shape (N,))")
        for a in arrays:
            if not np.all(np.isfinite(np.asarray(a, float))):
                raise ValueError(f"{who}: data contain NaN or infinite values")
        if config.likelihood == "bernoulli" and not np.all(np.isin(arrays[1], (0, 1))):
            raise ValueError(f"{who}: Bernoulli labels must be 0 or 1")
    n = int(clients.sizes.sum())
    m = config.num_inducing if config.fixed_inducing is None else len(config.fixed_inducing)
    if m > n:
        raise ValueError(f"num_inducing={m} exceeds the total number of training points {n}")


def _fixed_log_beta(config: SGPConfig, D: int) -> np.ndarray | None:
    h = config.fixed_hyper
    if h is None:
        return None
    vals = [np.broadcast_to(np.asarray(h["lengthscale"], float), (D,)), [h["variance"]]]
    if config.likelihood == "gaussian":
        vals.append([h["noise"]])
    out = np.log(np.concatenate(vals))
    if not np.all(np.isfinite(out)):
        raise ValueError(f"fixed_hyper values must be positive, got {h}")
    return out


def _spec(method: str, config: SGPConfig, D: int) -> sgp_pvi.Spec:
    factor = {"cpo": "cpo", "global": "opt" if config.likelihood == "gaussian" else "cpo"}
    z_mode = {"dpo": "hvm", "cpo": "hvm", "fedavg-z": "train", "fixed": "fixed",
              "global": "train"}[method]
    if config.fixed_inducing is not None:
        z_mode = "fixed"
    return sgp_pvi.Spec(factor.get(method, "dpo"), config.covariance, config.likelihood, z_mode,
                        config.fixed_hyper is None, float(config.alpha),
                        float(config.learning_rate), int(config.local_steps),
                        int(config.inner_steps) if method == "fedavg-z" else 0,
                        int(config.num_samples), float(config.damping), D)


def _init(method, spec, config, clients, key) -> sgp_pvi.SGPState:
    X_stack, y_stack = (np.asarray(a) for a in clients.stacked)
    mask, sizes = np.asarray(clients.mask), clients.sizes
    num_pseudo = np.maximum(1, np.minimum((config.pseudo_fraction * sizes).astype(int),
                                          config.max_pseudo))
    z_init, pseudo, m = config.fixed_inducing, None, config.num_inducing
    if z_init is not None:
        z_init = np.asarray(z_init, float)
        m = len(z_init)
        if len(np.unique(z_init, axis=0)) < m:
            warnings.warn("fixed_inducing has duplicate rows: K_ZZ is singular and only the "
                          "jitter keeps it invertible (the duplicates add nothing)", stacklevel=3)
    if method == "global":
        if z_init is None:
            rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
            z_init = X_stack[0][rng.choice(sizes[0], size=m, replace=False)]
        if spec.factor == "opt":
            pseudo = sg.Pseudo(X_stack, y_stack, np.zeros_like(y_stack))
    return sgp_pvi.init(spec, key, X_stack, mask, sizes, m, num_pseudo, config.init_precision,
                        config.pseudo_init == "data", z_init, _fixed_log_beta(config, X_stack.shape[2]),
                        pseudo)


@partial(jax.jit, static_argnums=0)
def _sequential_round(spec, state, k, X, y, mask, key):
    msg, fe = sgp_pvi.client_update(spec, state, k, (X[k], y[k], mask[k]), key)
    new, ok = sgp_pvi.server_update(spec, state, sgp_pvi.expand(msg), k[None])
    return new, ok, fe


@partial(jax.jit, static_argnums=0)
def _synchronous_round(spec, state, X, y, mask, key):
    K = X.shape[0]
    idx = jnp.arange(K)
    upd = jax.vmap(sgp_pvi.client_update, (None, None, 0, 0, 0))
    msgs, fe = upd(spec, state, idx, (X, y, mask), jax.random.split(key, K))
    new, ok = sgp_pvi.server_update(spec, state, msgs, idx)
    return new, ok, jnp.sum(fe)


@partial(jax.jit, static_argnums=(0, 6))
def _free_energy(spec, state, X, y, mask, key, num):
    return sgp_pvi.free_energy(spec, state, X, y, mask, key, num)


def fit_sgp(method: str, clients: Clients, num_rounds: int, config: SGPConfig = SGPConfig(),
            key: Array | None = None, callback: Callable[[int, dict], None] | None = None
            ) -> SGPResult:
    """Run ``num_rounds`` communications (sequential: one client each, cycling; synchronous: all
    clients per round; global: rounds of ``local_steps`` steps on the pooled data)."""
    _check(method, clients, config)
    if method == "global":
        clients = clients.pooled()
    key = jax.random.PRNGKey(0) if key is None else key
    X, y = (jnp.asarray(a, float) for a in clients.stacked)
    mask, K = clients.mask, clients.num_clients
    spec = _spec(method, config, X.shape[2])
    key, k0 = jax.random.split(key)
    state = _init(method, spec, config, clients, k0)
    sync = config.schedule == "synchronous" and method != "global"
    flat = (X.reshape(-1, X.shape[2]), y.reshape(-1), mask.reshape(-1))
    history: dict[str, list[Any]] = {k: [] for k in ("round", "communications", "passes",
                                                     "free_energy", "local_free_energy",
                                                     "seconds", "rejected")}
    fe_key = jax.random.PRNGKey(12345)
    for r in range(num_rounds):
        key, kr = jax.random.split(key)
        t0 = time.perf_counter()
        if sync:
            state, ok, local = _synchronous_round(spec, state, X, y, mask, kr)
            who = list(range(K))
        else:
            k = r % K
            state, ok, local = _sequential_round(spec, state, jnp.asarray(k), X, y, mask, kr)
            who = [k]
        jax.block_until_ready(state)
        seconds = time.perf_counter() - t0
        rejected = [clients.names[c] for c, a in zip(who, np.asarray(ok)) if not a]
        if rejected:
            warnings.warn(f"round {r}: rejected non-finite or improper updates from {rejected}",
                          stacklevel=2)
        comms = (r + 1) * (K if sync else 1)
        record = {"round": r + 1, "communications": comms, "passes": comms / K,
                  "free_energy": float(_free_energy(spec, state, *flat, fe_key, 4)),
                  "local_free_energy": float(local), "seconds": seconds, "rejected": rejected}
        for name, value in record.items():
            history[name].append(value)
        if callback is not None:
            callback(r + 1, record)
    return SGPResult(method, state, history, spec)
