"""``FSGP``: federated sparse GP regression by FedAvg of the Titsias bound (the FSGP baseline).

Training follows the FSGP paper: each round every client takes ``local_steps`` optimiser steps on
its own per-point collapsed bound from the server's parameters, and the server averages them with
weights ``N_k / N`` (synchronous: every client takes part every round, where the paper samples
``max(K rho, 1)`` of them). After the last round the server switches to its aggregation phase: one
more round in which each client sends ``A_k = C_MNk C_MNk^T``, ``b_k = C_MNk y_k`` and ``N_k``
(whitened by ``L^-1``, ``L = chol(C_MM + jitter I)``: the same posterior, computable where the
plain sums are not; :mod:`fedppl.algorithms.fsgp`), and the server predicts from the sums
(Eqs. 14-15 of the paper). Both phases are :mod:`fedppl.algorithms.fsgp`'s trio, run by the
embedded runtime.

Inputs and targets are expected standardised (``fedppl.datasets.Standardiser``).

Private statistics: ``privacy=PrivateStatistics(...)`` (:mod:`fedppl.algorithms.dp_statistics`)
noises the aggregation round's statistics on each client (one release per client; whitened rows
``L^-1 k(Z, x_n)``, whose squared norm is at most the kernel variance, and targets clipped first).
The result's ``privacy`` holds each client's ``epsilon``, the worst, and ``repaired`` (eigenvalues
the server raised to make the sum PSD); ``predict`` widens the variance by the noise's effect on the
mean. The FedAvg rounds' parameters and counts are not protected.

Example::

    >>> import jax, numpy as np, optax, fedppl
    >>> rng = np.random.default_rng(0)
    >>> X = rng.uniform(-2, 2, (60, 1)); y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=60)
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    >>> fsgp = FSGP(num_inducing=6, local_steps=20, optimizer=optax.adam(5e-2))
    >>> result = fsgp.run(jax.random.key(0), clients, num_rounds=3, progress_bar=False)
    >>> mean, var = result.predict(X[:4])                  # of y, in standardised units
    >>> mean.shape, result.history["round"].tolist(), result.aggregation["messages_up"]
    ((4,), [1, 2, 3], 3)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import metrics
from fedppl import validation as check
from fedppl.algorithms import exact
from fedppl.algorithms import fsgp as alg
from fedppl.algorithms.dp_statistics import PrivateStatistics
from fedppl.clients import Clients
from fedppl.infer import _gp_checks as chk
from fedppl.infer.base import FederatedMethod, Plan, Result, RunState, num_bytes, shared

__all__ = ["FSGP", "FSGPConfig", "FSGPResult", "INIT_INDUCING"]

INIT_INDUCING = ("client-data", "random-normal")


class FSGPConfig(NamedTuple):
    """Settings of :class:`FSGP` (each may also be given as a keyword argument).

    ``optimizer``: any optax optimiser for the clients' local steps.

    ``init_inducing``:

    * ``"client-data"`` (default, the paper's choice): ``Z`` is a uniformly random subset of the
      pooled training inputs. Privacy caveat: those M input rows are revealed to the server (and
      to every client through the shared ``Z``); use only where that is acceptable.
    * ``"random-normal"``: ``Z ~ N(0, I)`` draws, reasonable for standardised inputs; no data
      leave the clients before training.

    ``jitter``: added to ``C_MM``'s diagonal (absolute).

    ``privacy``: a :class:`~fedppl.algorithms.dp_statistics.PrivateStatistics` to release the
    statistics privately, or ``None``.
    """

    num_inducing: int = 100
    optimizer: optax.GradientTransformation = optax.adam(1e-2)
    local_steps: int = 200
    init_lengthscale: float = 1.0
    init_variance: float = 1.0
    init_noise: float = 0.1
    init_inducing: str = "client-data"
    jitter: float = alg.DEFAULT_JITTER
    privacy: PrivateStatistics | None = None


@dataclass(kw_only=True)
class FSGPResult(Result):
    """Trained parameters, the aggregated prediction statistics and the training history.

    ``history`` (one row per FedAvg round, round 1 first) has ``bound`` (sum over clients of the
    collapsed bounds, in nats, at the averaged parameters after that round) and the common keys.
    ``aggregation``: the final round's ``messages_up``, ``bytes_up``, ``rejected`` (counted in
    :meth:`summary`'s totals).
    """

    params: alg.FSGPParams
    stats: exact.Stats
    jitter: float = alg.DEFAULT_JITTER
    aggregation: dict[str, Any] = field(default_factory=dict)
    privacy: dict[str, Any] | None = None  # private runs: the spent epsilon (module doc)

    def predict(self, X: Any, noise_aware: bool = True) -> tuple[Array, Array]:
        """Predictive mean and variance of ``y`` (observation noise included) at ``X (n, D)``;
        in a private run q(u) weighs the noise in the statistics' projection in its likelihood,
        and the variance includes the scatter noise's effect on the mean unless
        ``noise_aware=False`` (:func:`fedppl.algorithms.fsgp.predict`)."""
        X = chk.check_inputs(X, self.params.inducing.shape[1])
        tau2 = None if self.privacy is None else self.privacy["stat_noise_var"]
        mean, var = _predict(self.params, self.stats, jnp.asarray(X), self.jitter, tau2,
                             noise_aware)
        if not bool(jnp.all(jnp.isfinite(mean)) & jnp.all(jnp.isfinite(var))):
            h = self.params.hyper
            cond = np.linalg.cond(np.asarray(alg.kuu(self.params, self.jitter)))
            raise FloatingPointError(
                f"FSGP's prediction is not finite: q(u) from the summed statistics is not "
                f"positive definite at the learnt hyperparameters (noise variance "
                f"{float(h.noise_var):.3g}, kernel variance {float(h.variance):.3g}; C_MM + "
                f"{self.jitter:g} I has condition number {cond:.3g}). Train with a larger "
                f"`jitter` (absolute, so in the kernel variance's units)")
        return mean, var

    def _original(self, X: Any, y: Any, y_mean: float, y_std: float):
        mean, var = self.predict(X)
        y = chk.check_targets(y, mean.shape[0])
        return (y, *metrics.unstandardise(mean, var, y_mean, y_std))

    def log_likelihood(self, X: Any, y: Any, y_mean: float = 0.0, y_std: float = 1.0) -> float:
        """Average test log-likelihood of ``y`` (original units; ``X`` as trained on)."""
        y, mean, var = self._original(X, y, y_mean, y_std)
        return metrics.gaussian_log_likelihood(y, mean, var)

    def rmse(self, X: Any, y: Any, y_mean: float = 0.0, y_std: float = 1.0) -> float:
        """Test RMSE of the predictive mean against ``y`` in original units."""
        y, mean, _ = self._original(X, y, y_mean, y_std)
        return metrics.rmse(y, mean)

    def rounds_to_convergence(self, rel_tol: float = 0.01) -> int | None:
        """First round after which the bound stays within ``rel_tol`` of its range."""
        return chk.converged_round(self.history["bound"], rel_tol)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        for key in ("messages_up", "bytes_up"):
            out[key] += int(self.aggregation.get(key, 0))
        if self.privacy is not None:
            out["epsilon"] = self.privacy["worst_epsilon"]
        return {**out, "bound": float(self.history["bound"][-1]),
                "rounds_to_convergence": self.rounds_to_convergence()}

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000):
        """Draws of the inducing outputs ``u = f(Z)`` from Titsias' optimal q(u) given the
        aggregated statistics; the trained hyperparameters and ``Z`` as constant data, as an
        ``xarray.DataTree`` for ArviZ 1.x (``num_samples`` draws as 4 chains). Needs
        ``pip install 'fedppl[arviz]'``."""
        from fedppl.arviz import check_num_samples

        key = jax.random.key(0) if rng_key is None else rng_key
        tau2 = None if self.privacy is None else self.privacy["stat_noise_var"]
        mean, cov = alg.inducing_posterior(self.params, self.stats, self.jitter, tau2)
        u = jax.random.multivariate_normal(key, mean, cov, (check_num_samples(num_samples),))
        h = self.params.hyper
        constant = {"lengthscale": h.lengthscale, "variance": h.variance, "noise": h.noise,
                    "Z": self.params.inducing}
        return chk.inference_data({"u": u}, constant, {
            "method": "FSGP", "num_rounds": self.num_rounds,
            "final_bound": float(self.history["bound"][-1])})


_predict = jax.jit(alg.predict, static_argnames=("jitter", "noise_aware"))
_bounds = jax.jit(jax.vmap(alg.bound, in_axes=(None, 0, 0, 0, None)), static_argnums=4)


class FSGP(FederatedMethod):
    """FedAvg of the collapsed bound, then the exact aggregation of inducing statistics.

    :param config: an :class:`FSGPConfig`; keyword arguments override its fields.
    """

    name = "FSGP"
    # the bar: the clients' summed collapsed bound; run(..., tol=) ends the FedAvg phase once
    # its relative change is at most tol
    progress: ClassVar[tuple[str, ...]] = ("bound",)
    tol_objective: ClassVar[str | None] = "bound"
    schedule = "synchronous"
    refusal = "non-finite parameters"

    def __init__(self, config: FSGPConfig | None = None, **settings: Any):
        if config is not None and not isinstance(config, FSGPConfig):
            raise TypeError(f"config must be an FSGPConfig, got {type(config).__name__}")
        unknown = set(settings) - set(FSGPConfig._fields)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}; FSGP takes "
                            f"{list(FSGPConfig._fields)}")
        self.config = _checked((config or FSGPConfig())._replace(**settings))

    def init(self, rng_key: Array, clients: Clients, *, runtime: Any = None,
             **kwargs: Any) -> RunState:
        """Check the clients' ``(X, y)`` and set up the run. ``Z`` is drawn with the first half
        of ``jax.random.split(rng_key)`` (the key stream of the original ``fit_fsgp``)."""
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        clients = chk.regression_clients(clients)
        total = int(clients.sizes.sum())
        if self.config.num_inducing > total:
            raise ValueError(f"num_inducing = {self.config.num_inducing} exceeds the total "
                             f"number of training points N = {total}; use M <= N (a sparse GP "
                             "needs M < N)")
        return super().init(rng_key, clients, runtime=runtime)

    def _plan(self, rng_key: Array, clients: Clients, *, data_at_server: bool = True,
              **kwargs: Any) -> Plan:
        # the first half of the run's key draws Z and starts the rounds (the second is unused)
        rng_key = z_key = jax.random.split(rng_key)[0]
        cfg = self.config
        if not data_at_server and cfg.init_inducing != "random-normal":
            raise ValueError(f"init_inducing={cfg.init_inducing!r} draws the inducing inputs from "
                             "the pooled data, which a deployment's server does not hold: use "
                             "init_inducing='random-normal'")
        D = clients.data[0][0].shape[1]
        params = alg.init_params(_init_inducing(clients, cfg, D, z_key), cfg.init_lengthscale,
                                 cfg.init_variance, cfg.init_noise)
        sigma = mechanism = None
        if cfg.privacy is not None:  # one release per client, in the aggregation round
            sigma = cfg.privacy.noise_multiplier_for(1)
            mechanism = cfg.privacy.mechanism(sigma)
        # one trio per settings in a process
        trio = shared(alg.make_trio, cfg.optimizer, int(cfg.local_steps), float(cfg.jitter),
                      mechanism)
        return Plan(trio, "synchronous", alg.init(params), (), self._row, self._result,
                    rng_key=rng_key, static=_Static(sigma))

    # -- the final phase -----------------------------------------------------------------------

    def aggregate(self, state: RunState) -> tuple[RunState, dict[str, Any]]:
        """The aggregation round: every client sends its inducing statistics at the trained
        parameters; the server adds the plausible ones. Returns the state and the round's
        record (counts, bytes, refused clients)."""
        server = state.server._replace(phase=jnp.asarray(alg.AGGREGATE))
        state, info = self.update(state._replace(server=server))
        return state, {**info, "refused": list(state.log.refused)}

    # -- the front's hooks ---------------------------------------------------------------------

    def _refused(self, replies: Array, active: np.ndarray) -> np.ndarray:
        return ~np.asarray(replies, bool)

    def _row(self, before, after, msgs, replies, active, rng_key) -> tuple[None, dict[str, Any]]:
        """A round's history columns: the bytes its messages cost in the round's phase (the
        server's, as the round began), and after a FedAvg round the summed bound."""
        plan = self._started(after)
        training = int(before.server.phase) == alg.TRAIN
        refused = [plan.names[k] for k in np.nonzero(active & ~np.asarray(replies, bool))[0]]
        what = "parameters" if training else "statistics"
        if refused:
            warnings.warn(f"FSGP server rejected {what} from {', '.join(refused)}; they were not "
                          "used", RuntimeWarning, stacklevel=3)
        row: dict[str, Any] = {"bytes_up": int(active.sum()) * _message_bytes(msgs, training)}
        if not training:
            return None, row
        if not plan.data_at_server:
            return None, {**row, "bound": np.nan}
        X, y = after.data
        bounds = _bounds(after.server.params, X, y, after.masks, float(self.config.jitter))
        return None, {**row, "bound": float(jnp.sum(bounds))}

    def _message_bytes(self, msgs: alg.Message) -> int:
        """Bytes of one client's message in a FedAvg round (an aggregation round's are
        counted by the round's row, which knows the phase)."""
        return _message_bytes(msgs, training=True)

    def _broadcast_bytes(self, server: alg.ServerState) -> int:
        return num_bytes(server.params)

    def _result(self, state: RunState, history, rejected) -> FSGPResult:
        state, info = self.aggregate(state)
        reason = "inducing statistics not finite, symmetric and positive semi-definite"
        rejected = rejected + [(state.round, who, reason) for who in info["refused"]]
        keep = ("seconds", "messages_up", "messages_down", "bytes_up", "bytes_down", "rejected")
        return FSGPResult(params=state.server.params, stats=state.server.stats,
                          jitter=float(self.config.jitter), history=history,
                          client_names=self._started(state).names, rejected=rejected,
                          aggregation={k: info[k] for k in keep},
                          privacy=self._privacy_result(state, info))

    def _privacy_result(self, state: RunState, info: dict[str, Any]) -> dict[str, Any] | None:
        privacy = self.config.privacy
        plan = self._started(state)
        if privacy is None or plan.static.sigma is None:
            return None
        K = len(plan.names)
        out = privacy.report(plan.static.sigma, np.ones(K, int))
        # the sum carries the noise of every client whose statistics the server added
        out["stat_noise_var"] = (K - len(info["refused"])) * out["noise_std"]**2
        out["repaired"] = int(state.server.repaired)
        return out


class _Static(NamedTuple):
    """FSGP's part of a plan (``plan.static``): a private run's noise multiplier (None: not
    private)."""

    sigma: float | None = None


def _message_bytes(msgs: alg.Message, training: bool) -> int:
    """Bytes of one client's message (messages stacked on the client axis): its parameters in
    a FedAvg round, its statistics in the aggregation round."""
    one = jax.tree_util.tree_map(lambda x: x[0], msgs)
    if training:
        return num_bytes(one.params)
    M = one.stats.proj.shape[0]  # a symmetric A_k needs only its lower triangle
    return int((M * (M + 1) // 2 + M + 1) * one.stats.proj.dtype.itemsize)


def _checked(cfg: FSGPConfig) -> FSGPConfig:
    check.positive_int(cfg.num_inducing, "num_inducing")
    check.positive_int(cfg.local_steps, "local_steps")
    check.optimizer(cfg.optimizer)
    for name in ("init_lengthscale", "init_variance", "init_noise"):
        check.positive(getattr(cfg, name), name)
    check.positive(cfg.jitter, "jitter", allow_zero=True)
    check.one_of(cfg.init_inducing, INIT_INDUCING, "init_inducing")
    if cfg.privacy is not None and not isinstance(cfg.privacy, PrivateStatistics):
        raise TypeError(f"privacy must be a fedppl.PrivateStatistics or None, got "
                        f"{type(cfg.privacy).__name__}")
    return cfg


def _init_inducing(clients: Clients, cfg: FSGPConfig, dim: int, key: Array) -> Array:
    M = cfg.num_inducing
    if cfg.init_inducing == "random-normal":
        return jax.random.normal(key, (M, dim))
    pooled = np.concatenate([np.asarray(clients.client(k)[0], dtype=np.float64)
                             for k in range(clients.num_clients)])
    rows = jax.random.choice(key, pooled.shape[0], (M,), replace=False)
    return jnp.asarray(pooled[np.asarray(rows)])
