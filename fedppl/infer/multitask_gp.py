"""``PFedMul``: federated multi-task GPs with mixed regression and classification tasks.

Each client holds rows ``(X, y, task)`` of several tasks (regression or Bernoulli-logit
classification, :class:`~fedppl.models.mogp.MOGPSpec`); every client fits its own sparse
multi-output GP by Polya-Gamma CAVI and the server learns the shared hyperparameter groups
(pFed-Mul; the trio is :mod:`fedppl.algorithms.pfedmul`). The result predicts each task with
each client's personal model.

Example::

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from fedppl.models import mogp
    >>> rng = np.random.default_rng(0)
    >>> spec = mogp.MOGPSpec(("regression", "classification"), num_latent=1)
    >>> def one(n):
    ...     x = rng.uniform(0, 5, (n, 1))
    ...     return [x, x], [np.sin(x[:, 0]), (np.sin(x[:, 0]) > 0).astype(float)]
    >>> clients = mogp.multitask_clients([one(10), one(12)], spec)
    >>> method = PFedMul(spec, mogp.init_hyper(spec, 1, W=jnp.ones((2, 1))), num_inducing=5)
    >>> result = method.run(jax.random.PRNGKey(0), clients, num_rounds=2, progress_bar=False)
    >>> result.history["round"].tolist(), result.predict(np.zeros((3, 1)), task=1)[0].shape
    ([1, 2], (2, 3))
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import validation as v
from fedppl.algorithms import pfedmul as pm
from fedppl.clients import Clients
from fedppl.infer.base import FederatedMethod, Plan, Result, RunState, shared
from fedppl.models import mogp
from fedppl.models.mogp import Data, Hyper, MOGPSpec
from fedppl.models.networks import MLP

__all__ = ["PFedMul", "PFedMulResult", "task_clients", "predict_latent", "probability"]

SCHEDULES = ("synchronous", "loop")


@dataclass(kw_only=True)
class PFedMulResult(Result):
    """The server's global hyperparameters, every client's personal model, and the history.

    ``history``: ``elbo`` (mean augmented ELBO of the accepted clients), ``client_elbo``
    (rounds, K; NaN for a client outside the round), ``exact_elbo`` (sum over clients of the
    ELBO under the exact likelihoods, Gauss-Hermite), and the common keys.
    """

    spec: MOGPSpec
    hyper: Hyper                  # the server's Theta
    clients: pm.ClientState       # stacked on the client axis
    data: tuple                   # (X, y, task), padded and stacked
    masks: Array

    def predict(self, X: Array, task: int, client: int | str | None = None
                ) -> tuple[Array, Array]:
        """Mean and variance of the latent function of ``task`` at ``X`` under a client's
        personal posterior: ``(N,)`` each for one client, ``(K, N)`` for ``client=None``."""
        X = _check_inputs(X, self.data[0].shape[-1], "X")
        task = _check_task(task, len(self.spec.kinds))
        k = None if client is None else self._client_index(client, self.masks.shape[0])
        mean, var = predict_latent(self.spec, self.clients, jnp.asarray(X), task)
        return (mean, var) if k is None else (mean[k], var[k])

    def predict_proba(self, X: Array, task: int, client: int | str | None = None,
                      order: int = 20) -> Array:
        """``p(y = 1 | x)`` of a classification task: the logistic function averaged over the
        latent's posterior by ``order``-point Gauss-Hermite quadrature."""
        if self.spec.kinds[_check_task(task, len(self.spec.kinds))] != "classification":
            raise ValueError(f"task {task} is a {self.spec.kinds[task]} task; predict_proba "
                             "needs a classification task")
        return probability(*self.predict(X, task, client), order)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["elbo"] = float(self.history["elbo"][-1])
        out["exact_elbo"] = float(self.history["exact_elbo"][-1])
        return out

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 500):
        """An ``xarray.DataTree`` for ArviZ 1.x: draws of every client's inducing outputs
        ``u_b`` (the model's sites, dims ``client, inducing``; ``num_samples`` draws as 4
        chains) in ``posterior``; the latent means and variances at each client's own rows (NaN
        on padding) in ``predictions``; inducing inputs, task labels and the global and
        personal hyperparameters in ``constant_data``."""
        from fedppl import arviz

        num_samples = arviz.check_num_samples(num_samples)
        rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        K, B = self.masks.shape[0], self.spec.num_latent
        u = _draw_u(rng_key, self.clients.q, num_samples)          # (S, K, B*M)
        u = np.asarray(u).reshape(num_samples, K, B, -1)
        posterior = {f"u_{b}": arviz.as_chains(u[:, :, b]) for b in range(B)}
        X, _, task = self.data
        mean, var = jax.vmap(_predict_rows, (None, 0, 0, 0))(self.spec, self.clients, X, task)
        mask = np.asarray(self.masks)
        predictions = {"f_mean": np.where(mask, mean, np.nan)[None, None],
                       "f_var": np.where(mask, var, np.nan)[None, None]}
        constant = {"Z": np.asarray(self.clients.Z), "task": np.where(mask, task, -1),
                    **_hyper_arrays(self.hyper, ""), **_hyper_arrays(self.clients.hyper, "client_")}
        dims = {**{f"u_{b}": ["client", "inducing"] for b in range(B)},
                "Z": ["client", "inducing", "input"], "task": ["client", "obs"],
                "log_phi0": ["latent"], "log_phi1": ["latent"], "W": ["task", "latent"],
                "log_noise": ["task"], "client_log_phi0": ["client", "latent"],
                "client_log_phi1": ["client", "latent"], "client_W": ["client", "task", "latent"],
                "client_log_noise": ["client", "task"]}
        coords = {"client": list(self.client_names) or list(range(K))}
        return arviz.from_dict(
            {"posterior": posterior, "predictions": predictions, "constant_data": constant},
            coords=coords, dims=dims, pred_coords=coords,
            pred_dims={"f_mean": ["client", "obs"], "f_var": ["client", "obs"]},
            attrs={"posterior": {"num_rounds": self.num_rounds,
                                 "final_elbo": float(self.history["elbo"][-1])}})


def _hyper_arrays(hyper: Hyper, prefix: str) -> dict[str, np.ndarray]:
    return {prefix + k: np.asarray(getattr(hyper, k))
            for k in ("log_phi0", "log_phi1", "W", "log_noise")}


@partial(jax.jit, static_argnums=2)
def _draw_u(key: Array, q: mogp.QU, num_samples: int) -> Array:
    L = jnp.linalg.cholesky(q.cov)                                   # (K, BM, BM)
    eps = jax.random.normal(key, (num_samples, *q.mean.shape))      # (S, K, BM)
    return q.mean + jnp.einsum("kij,skj->ski", L, eps)


def _predict_rows(spec: MOGPSpec, st: pm.ClientState, X: Array, task: Array):
    return mogp.marginals(spec, st.hyper, st.Z, X, task.astype(jnp.int32), st.q)


@partial(jax.jit, static_argnums=(0, 3))
def predict_latent(spec: MOGPSpec, clients: pm.ClientState, X: Array, task: int
                   ) -> tuple[Array, Array]:
    """Mean and variance ``(K, N)`` of task ``task``'s latent function at ``X`` under every
    client's personal posterior (``clients``: the stacked client states of a run)."""
    return jax.vmap(lambda st: mogp.predict(spec, st.hyper, st.Z, st.q, X, task))(clients)


def probability(mean: Array, var: Array, order: int = 20) -> Array:
    """``E[sigmoid(f)]`` for ``f ~ N(mean, var)`` by ``order``-point Gauss-Hermite quadrature."""
    x, w = np.polynomial.hermite_e.hermegauss(order)
    f = jnp.asarray(mean)[..., None] + jnp.sqrt(jnp.asarray(var))[..., None] * x
    return jax.nn.sigmoid(f) @ w / np.sqrt(2 * np.pi)


@partial(jax.jit, static_argnums=0)
def _exact_elbo(spec: MOGPSpec, clients: pm.ClientState, data: tuple, masks: Array) -> Array:
    def one(st, X, y, task, mask):
        return mogp.exact_elbo(spec, st.hyper, st.Z, Data(X, y, task, mask), st.q)
    return jnp.sum(jax.vmap(one)(clients, *data, masks))


class PFedMul(FederatedMethod):
    """pFed-Mul (or its Gaussian-VI baseline) over clients holding several tasks each.

    :param spec: the tasks' kinds, the number of latent GPs and the base kernel.
    :param hyper: the starting hyperparameters Theta (:func:`fedppl.models.mogp.init_hyper`).
    :param method: ``"pfed-mul"`` (Polya-Gamma CAVI) or ``"gaussian-vi"`` (Monte Carlo VI of a
        full Gaussian ``q(u)`` under the exact logistic likelihood).
    :param variant: which groups of Theta are global: ``"network"``, ``"kernel"``,
        ``"kernel+W"`` or ``"all"``; the rest are personal to each client.
    :param fixed: groups never trained (of ``"network"``, ``"kernel"``, ``"W"``, ``"noise"``).
    :param schedule: ``"synchronous"`` (clients vmapped) or ``"loop"`` (a Python loop over the
        clients; the same numbers).
    :param fraction: the share of clients drawn to take part in each round, in (0, 1].
    :param num_inducing: inducing inputs per client, drawn from its own rows (at most the
        smallest client's number of rows, so that every client has the same number).
    :param cavi_iters: CAVI sweeps per round.
    :param local_steps: steps of ``optimizer`` on the personal groups per round.
    :param optimizer: the clients' optax optimiser (default ``adam(1e-2)``).
    :param server_optimizer: the server's optax optimiser for its ascent step on the averaged
        ELBO (default ``adam(1e-2)``).
    :param vi_optimizer: Gaussian-VI's optax optimiser for ``q(u)`` (default ``adam(5e-2)``).
    :param vi_steps: Gaussian-VI steps on ``q(u)`` per round.
    :param vi_samples: Gaussian-VI Monte Carlo draws per step.
    """

    name = "pFed-Mul"
    refusal = "message not finite"
    # the bar: the accepted clients' mean augmented ELBO, the exact ELBO; run(..., tol=) stops
    # on the exact ELBO's relative change (a deployment's server, without data, has none)
    progress: ClassVar[tuple[str, ...]] = ("elbo", "exact_elbo")
    tol_objective: ClassVar[str | None] = "exact_elbo"

    def __init__(self, spec: MOGPSpec, hyper: Hyper, *, method: str = "pfed-mul",
                 variant: str = "all", fixed: tuple[str, ...] = (),
                 schedule: str = "synchronous", fraction: float = 1.0, num_inducing: int = 20,
                 cavi_iters: int = 2, local_steps: int = 1,
                 optimizer: optax.GradientTransformation | None = None,
                 server_optimizer: optax.GradientTransformation | None = None,
                 vi_optimizer: optax.GradientTransformation | None = None, vi_steps: int = 2,
                 vi_samples: int = 8):
        _check_spec(spec)
        _check_hyper(spec, hyper)
        v.one_of(method, pm.METHODS, "method")
        v.one_of(variant, tuple(pm.VARIANTS), "variant")
        if isinstance(fixed, str) or not set(fixed) <= set(pm.GROUPS):
            raise ValueError(f"fixed must be a tuple of groups from {pm.GROUPS}, got {fixed!r}")
        v.one_of(schedule, SCHEDULES, "schedule (the server averages a round's gradients)")
        # strong dtypes: a weakly typed leaf would compile the round twice (its output is strong)
        hyper = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.result_type(x)), hyper)
        self.spec, self.hyper, self.schedule = spec, hyper, schedule
        self.fraction = v.fraction(fraction, "fraction")
        self.num_inducing = v.positive_int(num_inducing, "num_inducing")
        self.config = pm.Config(
            spec, method, variant, tuple(fixed), v.positive_int(cavi_iters, "cavi_iters"),
            v.positive_int(local_steps, "local_steps", minimum=0),
            v.positive_int(vi_steps, "vi_steps"), v.positive_int(vi_samples, "vi_samples"),
            v.optimizer(optimizer if optimizer is not None else optax.adam(1e-2)),
            v.optimizer(server_optimizer if server_optimizer is not None else optax.adam(1e-2),
                        "server_optimizer"),
            v.optimizer(vi_optimizer if vi_optimizer is not None else optax.adam(5e-2),
                        "vi_optimizer"))
        self._trio = shared(pm.make_trio, self.config)  # one per config in a process

    def single_task(self, task: int, hyper: Hyper) -> PFedMul:
        """pFed-St: the same settings on task ``task`` alone, one latent GP, ``W = 1`` fixed,
        starting from ``hyper`` (for the one-task spec); run it on :func:`task_clients`."""
        task = _check_task(task, len(self.spec.kinds))
        c = pm.single_task_config(self.config, task)
        return PFedMul(c.spec, hyper, method=c.method, variant=c.variant, fixed=c.fixed,
                       schedule=self.schedule, fraction=self.fraction,
                       num_inducing=self.num_inducing, cavi_iters=c.cavi_iters,
                       local_steps=c.local_steps, optimizer=c.optimizer,
                       server_optimizer=c.server_optimizer, vi_optimizer=c.vi_optimizer,
                       vi_steps=c.vi_steps, vi_samples=c.vi_samples)

    # -- the front's hooks ---------------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, *, runtime: Any = None,
             **kwargs: Any) -> RunState:
        """Check the clients' rows, draw each client's inducing inputs and set up the states.

        The key splits as pFed-Mul's reference code did: the first half draws the inducing
        inputs, the second is the rounds' key (round ``r`` uses ``split(key, R)[r]``)."""
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        clients = _check_clients(self.spec, self.hyper, clients)
        k_inducing, k_rounds = jax.random.split(v.rng_key(rng_key))
        state = super().init(rng_key, clients, inducing_key=k_inducing, runtime=runtime)
        return state._replace(rng_key=k_rounds)

    def _plan(self, rng_key: Array, clients: Clients, *, inducing_key: Array,
              data_at_server: bool = True) -> Plan:
        sizes = clients.sizes
        M = min(self.num_inducing, int(sizes.min()))
        if self.num_inducing > M and np.any(sizes < self.num_inducing) and \
                np.any(sizes > M):
            warnings.warn(f"{clients.names[int(np.argmin(sizes))]} has only {M} rows: every "
                          f"client uses {M} inducing inputs instead of {self.num_inducing}",
                          UserWarning, stacklevel=4)
        X, mask = clients.stacked[0], np.asarray(clients.mask)
        keys = jax.random.split(inducing_key, clients.num_clients)
        Z = jnp.stack([mogp.sample_inducing(keys[k], Data(X[k], None, None, mask[k]), M)
                       for k in range(clients.num_clients)])
        server = pm.init_server(self.config, self.hyper)
        cstates = pm.init_clients(self.config, self.hyper, Z, clients.max_size)
        return Plan(self._trio, self.schedule, server, cstates, self._row, self._result,
                    rng_key=rng_key)  # init replaces the rounds' key

    def _round_inputs(self, state: RunState):
        K = state.masks.shape[0]
        keys, active = pm.round_keys(state.rng_key, state.round, K, self.fraction)
        return state.rng_key, keys, jnp.asarray(active), None, None

    def _broadcast_bytes(self, server: pm.ServerState) -> int:
        from fedppl.infer.base import num_bytes

        return num_bytes(server.hyper)

    def _refused(self, replies: Array, active: np.ndarray) -> np.ndarray:
        return ~np.asarray(replies, bool)

    def _row(self, before, after, msgs, replies, active, rng_key) -> tuple[None, dict[str, Any]]:
        ok = np.asarray(replies, bool) & active
        elbo = np.asarray(msgs.elbo, float)
        return None, {"elbo": float(np.mean(elbo[ok])) if ok.any() else np.nan,
                "client_elbo": np.where(active, elbo, np.nan),
                "exact_elbo": float(_exact_elbo(self.spec, after.clients, after.data,
                                                after.masks))
                if self._started(after).data_at_server
                else np.nan}  # a deployment's server holds no data

    def _result(self, state: RunState, history, rejected) -> PFedMulResult:
        return PFedMulResult(history=history, client_names=self._started(state).names,
                             rejected=rejected,
                             spec=self.spec, hyper=state.server.hyper, clients=state.clients,
                             data=state.data, masks=state.masks)


# -- clients of one task ---------------------------------------------------------------------------


def task_clients(clients: Clients, task: int) -> Clients:
    """Every client's rows of task ``task``, relabelled as task 0 (pFed-St's data); a client
    without rows of that task is an error naming it."""
    out = []
    for name, (X, y, t) in zip(clients.names, clients.data, strict=True):
        keep = np.asarray(t) == task
        if not keep.any():
            raise ValueError(f"{name} has no rows of task {task}")
        out.append((np.asarray(X)[keep], np.asarray(y)[keep], np.zeros(int(keep.sum()), int)))
    return clients.with_data(out)


# -- validation (before anything is compiled) ------------------------------------------------------


def _check_task(task: Any, num_tasks: int) -> int:
    task = v.positive_int(task, "task", minimum=0)
    if task >= num_tasks:
        raise ValueError(f"task must be an index in 0..{num_tasks - 1}, got {task}")
    return task


def _check_inputs(X: Any, dim: int, name: str) -> np.ndarray:
    v.inputs_2d(X, "predict", dim, name)
    X = np.asarray(X)
    if not np.issubdtype(X.dtype, np.number) or not np.all(np.isfinite(X)):
        raise ValueError(f"predict: {name} must be finite numbers")
    return X.astype(float)


def _check_spec(spec: Any) -> None:
    if not isinstance(spec, MOGPSpec):
        raise TypeError(f"spec must be a fedppl.models.mogp.MOGPSpec, got {type(spec).__name__}")
    bad = [k for k in spec.kinds if k not in mogp.TASK_KINDS]
    if not spec.kinds or bad:
        raise ValueError(f"spec.kinds must name tasks from {mogp.TASK_KINDS}, got {spec.kinds}")
    if spec.kernel not in mogp.KERNELS:
        raise ValueError(f"spec.kernel must be one of {mogp.KERNELS}, got {spec.kernel!r}")
    v.positive_int(spec.num_latent, "spec.num_latent")


def _check_hyper(spec: MOGPSpec, hyper: Any) -> None:
    if not isinstance(hyper, Hyper):
        raise TypeError("hyper must be a fedppl.models.mogp.Hyper (see mogp.init_hyper), got "
                        f"{type(hyper).__name__}")
    T, B = len(spec.kinds), spec.num_latent
    nets = hyper.net if isinstance(hyper.net, tuple) else (hyper.net,)
    if not nets or not all(isinstance(n, MLP) for n in nets):
        raise TypeError("hyper.net must be a fedppl.models.networks.MLP or a tuple of them, got "
                        f"{type(hyper.net).__name__}")
    if isinstance(hyper.net, tuple) and len(nets) != B:
        raise ValueError(f"hyper.net is a tuple of {len(nets)} networks; one per latent GP "
                         f"needs {B}")
    if len({n.widths for n in nets}) > 1:
        raise ValueError("the latent GPs' networks must have the same widths, got "
                         f"{[n.widths for n in nets]}")
    want = {"log_phi0": (B,), "log_phi1": (B,), "W": (T, B), "log_noise": (T,)}
    for name, shape in want.items():
        value = np.asarray(getattr(hyper, name))
        if value.shape != shape:
            raise ValueError(f"hyper.{name} must have shape {shape} for {T} tasks and {B} "
                             f"latent GPs, got {value.shape}")
    for leaf in jax.tree_util.tree_leaves(hyper):
        if not np.all(np.isfinite(np.asarray(leaf))):
            raise ValueError("hyper has NaN or infinite values")


def _input_dim(hyper: Hyper) -> int | None:
    net = hyper.net[0] if isinstance(hyper.net, tuple) else hyper.net
    return net.widths[0] if net.widths else None


def _check_clients(spec: MOGPSpec, hyper: Hyper, clients: Any) -> Clients:
    """``(X (N, D), y (N,), task (N,))`` per client: task labels in range, classification
    labels in {0, 1}; returned as float inputs and targets and integer tasks."""
    if not isinstance(clients, Clients):
        raise TypeError("clients must be a fedppl.Clients of (X, y, task) per client (see "
                        f"fedppl.models.mogp.multitask_clients), got {type(clients).__name__}")
    dim, out = _input_dim(hyper), []
    for name, arrays in zip(clients.names, clients.data, strict=True):
        if len(arrays) != 3:
            raise ValueError(f"{name}: expected arrays (X, y, task), got {len(arrays)} arrays")
        X, y, task = (np.asarray(a) for a in arrays)
        v.inputs_2d(X, name, dim)
        if y.ndim != 1 or task.ndim != 1:
            raise ValueError(f"{name}: y and task must be 1-D, got shapes {y.shape}, "
                             f"{task.shape}")
        for what, a in (("X", X), ("y", y)):
            if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
                raise ValueError(f"{name}: {what} must be real numbers, got dtype {a.dtype}")
        v.labels_in(task, range(len(spec.kinds)), name, "task labels")
        cls = np.isin(task, [t for t, k in enumerate(spec.kinds) if k == "classification"])
        v.labels_in(y[cls], (0, 1), name, "classification labels")
        out.append((X.astype(float), y.astype(float), task.astype(np.int32)))
    return clients.with_data(out)
