"""``FedBNR``: a global random-feature GP learned across clients (Alg. 1 of the FedBNR paper).

Phase 1 learns the kernel; phase 2 fits the Bayesian last layer exactly from the clients'
sufficient statistics. Both run as one trio (:mod:`fedppl.algorithms.fedbnr`) on the embedded
runtime, the phase held in the server's state. The paper's variants and ablations are the
combinations of

* ``kernel``: ``"avg"`` (FedAvg), ``"kd"`` (knowledge distillation on server data), ``"local"``
  (each client its own kernel) or ``"central"`` (pooled data: the reference);
* ``last_layer``: ``"global"`` (exact aggregation over all clients) or ``"local"`` (each client's
  own data only).

FedBNR is ``avg + global``, FedBNR-KD ``kd + global``; models that stay per client are scored as
the average over clients, as in the paper. Every evaluation forms both last layers from the same
statistics, so one run scores both (``result.predict(X, last_layer="local")``); ``last_layer``
picks the one that validation selects on and that ``predict`` uses by default.

Validation data (``validation=(X_val, y_val)``, standardised like the training data) enables
early stopping: every ``eval_every`` rounds (and at the last round) the server scores the last
layer by RMSE, keeps the best kernels and stops after ``patience`` evaluations without
improvement. Without validation data the run takes all ``num_rounds`` rounds and keeps the last
kernels, with their last layer formed at the last round.

Private statistics: ``privacy=PrivateStatistics(...)`` (:mod:`fedppl.algorithms.dp_statistics`)
noises every client's statistics at every evaluation (clipped features and targets, Gaussian noise
added on the client); ``epsilon`` is calibrated for the evaluations the run plans (``num_rounds //
eval_every`` plus the last round, times the kernels each client evaluates: 1 shared, K per client).
The result's ``privacy`` holds each client's spent ``epsilon`` and the worst, ``history["epsilon"]``
the running total and ``history["repaired"]`` the eigenvalues the server raised to make the summed
scatter PSD; ``predict`` widens the variances by the noise's effect on the mean. The phase-1 kernels
and log marginal likelihoods are sent in the clear: only the statistics are protected.

Example::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models.random_features import URKSpec
    >>> X = np.linspace(-3, 3, 80)[:, None]; y = np.sin(X[:, 0])
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=2, seed=0)
    >>> spec = URKSpec(input_dim=1, feature_widths=(), shift_widths=(), num_samples=10)
    >>> method = FedBNR(spec, kernel="avg", local_steps=5)
    >>> result = method.run(jax.random.key(0), clients, num_rounds=3, progress_bar=False,
    ...                     validation=(X[::7], y[::7]))
    >>> mean, var = result.predict(X[:4])         # (models, n): one model for avg + global
    >>> mean.shape, result.history["round"].tolist()
    ((1, 4), [1, 2, 3])
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array

from fedppl import trees
from fedppl.algorithms import fedbnr as alg
from fedppl.algorithms.dp_statistics import PrivateStatistics
from fedppl.algorithms.trio import Trio
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.infer.base import (
    FederatedMethod,
    Plan,
    Result,
    RunState,
    check_rounds,
    num_bytes,
    shared,
)
from fedppl.models.random_features import URKSpec, base_draws, check_spec, init_urk
from fedppl.validation import optimizer as check_optimizer
from fedppl.validation import rng_key as check_key

__all__ = ["FedBNR", "FedBNRResult", "KERNELS", "LAST_LAYERS"]

KERNELS = alg.KERNELS
LAST_LAYERS = ("global", "local")
SCHEDULES = ("synchronous", "loop")


@dataclass(kw_only=True)
class FedBNRResult(Result):
    """The learnt kernels and their exact last layers.

    ``kernels`` has a leading model axis (``M = 1`` for a shared or central kernel, else one per
    client); ``layers`` holds both last layers under them. ``history`` has, besides the common
    keys, ``elbo`` (the clients' summed log marginal likelihoods under the kernels each round
    starts from: the phase-1 objective, which the exact last layer's ELBO equals), ``val_rmse``
    (NaN where the round was not an evaluation), ``evaluated`` and ``phase`` (2 once the kernels
    are final). ``best_round`` is the round the kernels come from; ``rounds_to_convergence`` the
    round early stopping ended phase 1 (``None``: it ran every round).
    """

    spec: URKSpec
    kernel: str
    last_layer: str
    kernels: alg.BNRParams
    layers: alg.LastLayer
    omega: Array
    best_round: int | None = None
    rounds_to_convergence: int | None = None
    privacy: dict[str, Any] | None = None  # private runs: the spent epsilon (module doc)

    def models(self, last_layer: str | None = None) -> tuple[alg.BNRParams, g.FullGaussian]:
        """The kernel and last-layer posterior of each model, stacked on axis 0."""
        last_layer = _choice(self.last_layer if last_layer is None else last_layer,
                             LAST_LAYERS, "last_layer")
        post = self.layers.global_ if last_layer == "global" else self.layers.local
        shared = self.kernel in ("avg", "kd")
        return alg.model_kernels(self.kernels, post.nat1.shape[0], shared, last_layer), post

    @property
    def num_models(self) -> int:
        return int(self.models()[1].nat1.shape[0])

    def predict(self, X: Any, last_layer: str | None = None, noise_aware: bool = True
                ) -> tuple[Array, Array]:
        """Predictive means and variances (noise included) at ``X (n, input_dim)``, each of shape
        ``(models, n)``; ``last_layer`` overrides the method's choice. In a private run the
        variances include the privacy noise's effect on the mean unless ``noise_aware=False``
        (:func:`fedppl.algorithms.dp_statistics.mean_noise_variance`)."""
        X = _check_inputs(X, self.spec.input_dim, "X")
        which = _choice(self.last_layer if last_layer is None else last_layer, LAST_LAYERS,
                        "last_layer")
        kernels, post = self.models(which)
        if self.privacy is None or not noise_aware:
            return _predict(kernels, post, self.omega, jnp.asarray(X))
        tau2 = jnp.full(post.nat1.shape[0], self.privacy["stat_noise_var"][which])
        return _predict_noisy(kernels, post, self.omega, jnp.asarray(X), tau2)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        val = self.history.get("val_rmse", np.array([]))
        scores = val[np.isfinite(val)]
        out.update(kernel=self.kernel, last_layer=self.last_layer, best_round=self.best_round,
                   rounds_to_convergence=self.rounds_to_convergence,
                   best_val_rmse=float(scores.min()) if scores.size else None)
        if self.privacy is not None:
            out["epsilon"] = self.privacy["worst_epsilon"]
        return out

    def to_arviz(self, rng_key: Array | None = None, num_samples: int = 1000,
                 last_layer: str | None = None):
        """Draws of the last-layer weights ``w`` (dims ``regressor, feature``: one regressor
        per model, not ``model``, which ArviZ 1.x's plots read as models to compare) from each
        model's exact posterior (``num_samples`` as 4 chains), each model's noise and prior
        scale as constant data, and the run's summary as attributes: an ``xarray.DataTree``
        for ArviZ 1.x (needs ``pip install 'fedppl[arviz]'``)."""
        from fedppl import arviz

        num_samples = arviz.check_num_samples(num_samples)
        kernels, post = self.models(last_layer)
        key = jax.random.key(0) if rng_key is None else rng_key
        keys = jax.random.split(key, post.nat1.shape[0])
        draws = jax.vmap(lambda k, p: g.sample(k, p, num_samples), out_axes=1)(keys, post)
        return arviz.from_dict(
            {"posterior": {"w": arviz.as_chains(draws)},
             "constant_data": {"noise": kernels.noise, "prior_scale": kernels.prior_scale}},
            dims={"w": ["regressor", "feature"], "noise": ["regressor"],
                  "prior_scale": ["regressor"]},
            attrs={"posterior": self.summary()})


@jax.jit
def _predict(kernels, posteriors, omega, X):
    return alg.predict(kernels, posteriors, omega, X)


@jax.jit
def _predict_noisy(kernels, posteriors, omega, X, stat_noise_var):
    return alg.predict(kernels, posteriors, omega, X, stat_noise_var)


class FedBNR(FederatedMethod):
    """Two-phase federated Bayesian neural regression (standardised inputs and targets).

    :param spec: the URK architecture (:class:`~fedppl.models.random_features.URKSpec`).
    :param kernel: ``"avg"``, ``"kd"``, ``"local"`` or ``"central"`` (phase 1).
    :param last_layer: ``"global"`` or ``"local"`` (phase 2: the one validated and predicted
        with by default; ``"central"`` pools the data, so its last layer is global).
    :param optimizer: any optax optimiser for the local (and distillation) steps
        (default ``optax.adam(1e-2)``).
    :param local_steps: full-batch steps per round on each client.
    :param kd_alpha, kd_steps: weight of the kernel-matching term and server steps (``"kd"``).
    :param eval_every, patience: evaluate every ``eval_every`` rounds; stop after ``patience``
        evaluations without improvement of the validation RMSE.
    :param noise, prior_scale: initial sigma and lambda (positive, standardised units).
    :param schedule: ``"synchronous"`` (clients vmapped) or ``"loop"`` (a Python loop over the
        clients); FedAvg has no sequential form.
    :param privacy: a :class:`~fedppl.algorithms.dp_statistics.PrivateStatistics`: noise the
        statistics (see the module doc), or ``None``.
    """

    name = "FedBNR"
    # the bar: the clients' summed log marginal likelihood, the validation RMSE, the phase
    progress: ClassVar[tuple[str, ...]] = ("elbo", "val_rmse", "phase", "epsilon:max")

    def __init__(self, spec: URKSpec, kernel: str = "avg", last_layer: str = "global", *,
                 optimizer: optax.GradientTransformation | None = None, local_steps: int = 50,
                 kd_alpha: float = 5.0, kd_steps: int = 50, eval_every: int = 5,
                 patience: int = 5, noise: float = 0.3, prior_scale: float = 1.0,
                 schedule: str = "synchronous", privacy: PrivateStatistics | None = None):
        self.spec = check_spec(spec)
        self.kernel = _choice(kernel, KERNELS, "kernel")
        self.last_layer = _choice(last_layer, LAST_LAYERS, "last_layer")
        if kernel == "central" and last_layer == "local":
            raise ValueError("kernel='central' learns on the pooled data, so its last layer is "
                             "global; last_layer='local' needs a federated kernel")
        self.schedule = _choice(schedule, SCHEDULES, "schedule")
        self.optimizer = check_optimizer(optax.adam(1e-2) if optimizer is None else optimizer)
        self.local_steps = _count(local_steps, "local_steps")
        self.kd_steps = _count(kd_steps, "kd_steps")
        self.eval_every = _count(eval_every, "eval_every")
        self.patience = _count(patience, "patience")
        self.kd_alpha = _number(kd_alpha, "kd_alpha", positive=False)
        self.noise = _number(noise, "noise")
        self.prior_scale = _number(prior_scale, "prior_scale")
        if privacy is not None and not isinstance(privacy, PrivateStatistics):
            raise TypeError(f"privacy must be a fedppl.PrivateStatistics or None, "
                            f"got {type(privacy).__name__}")
        self.privacy = privacy
        self._settings = alg.Settings(kernel, self.optimizer, self.local_steps, self.kd_alpha,
                                      self.kd_steps, self.eval_every, self.patience)

    @property
    def shared(self) -> bool:
        return self.kernel in ("avg", "kd")

    # -- the plan ------------------------------------------------------------------------------

    def _plan(self, rng_key: Array, clients: Clients, *, keys: tuple[Array, Array],
              final_round: int, kd_data: tuple | None, validation: tuple | None,
              data_at_server: bool = True) -> Plan:
        rng_key = jax.random.split(rng_key)[0]  # the rounds' key: init replaces it by k_run
        trio, private = self._make_trio(clients.num_clients, final_round)
        k_omega, k_init = keys  # the stream FedBNR always drew from
        omega = base_draws(k_omega, self.spec)
        params = alg.init_params(init_urk(k_init, self.spec), self.noise, self.prior_scale)
        K = clients.num_clients
        server = alg.init_server(params, omega, 1 if self.shared else K, num_clients=K,
                                 final_round=final_round, kd_data=kd_data,
                                 validation=validation)
        cstates = alg.init_clients(params, K, private=self.privacy is not None)
        assert trio.client_evaluate is not None  # FedBNR's trio has its evaluation exchange
        stats = jax.eval_shape(trio.client_evaluate, (server.kernels, omega),
                               trees.first(cstates), trees.first(clients.stacked), clients.mask[0])
        stats_bytes = sum(math.prod(s.shape) * s.dtype.itemsize
                          for s in jax.tree_util.tree_leaves(stats))
        return Plan(trio, self.schedule, server, cstates, self._row, self._result,
                    log=_Log(), rng_key=rng_key, static=_Static(stats_bytes, private))

    def _make_trio(self, num_clients: int, final_round: int) -> tuple[Trio, _Private | None]:
        """The run's trio (one that noises the statistics in a private run) and a private
        run's calibration for the planned releases."""
        if self.privacy is None:
            return shared(alg.make_trio, self._settings, self.last_layer), None
        private = _calibrate(self.privacy, 1 if self.shared else num_clients, self.eval_every,
                             final_round)
        settings = self._settings._replace(privacy=self.privacy.mechanism(private.sigma))
        return shared(alg.make_trio, settings, self.last_layer), private

    # -- the front's hooks ---------------------------------------------------------------------

    def _round_inputs(self, state: RunState):
        # FedBNR's own key stream: (k_run, key) = split(k_run) each round, a key per client
        rng_key, key = jax.random.split(state.rng_key)
        K = state.masks.shape[0]
        return rng_key, jax.random.split(key, K), jnp.ones(K, bool), key, key

    def _broadcast_bytes(self, server: alg.ServerState) -> int:
        return num_bytes(server.kernels) if self.shared and not bool(server.done) else 0

    def _refused(self, replies: Array, active: np.ndarray) -> np.ndarray:
        return ~np.asarray(replies, bool)

    def _row(self, before: RunState, after: RunState, msgs: alg.KernelMessage, replies: Any,
             active: np.ndarray, rng_key: Array) -> tuple[_Log, dict[str, Any]]:
        """A round's history columns, and the privacy accounting after it."""
        static: _Static = self._started(after).static
        srv = after.server
        n = 0 if bool(before.server.done) else int(active.sum())
        evaluated = bool(srv.evaluated)
        log_ml = np.where(active, np.asarray(msgs.log_ml), 0.0)
        # the evaluation is one more exchange: the kernels out, the statistics back
        row = {"messages_up": n * (1 + evaluated), "messages_down": n * (1 + evaluated),
               "bytes_up": n * (self._message_bytes(msgs) + evaluated * static.stats_bytes),
               "bytes_down": n * (self._broadcast_bytes(before.server)
                                  + evaluated * num_bytes(srv.kernels)),
               "elbo": float(log_ml.sum()) if n else np.nan, "val_rmse": float(srv.score),
               "evaluated": evaluated, "phase": 2 if bool(srv.done) else 1}
        log: _Log = after.log.method
        if self.privacy is None or static.private is None:
            return log, row
        log = _account(log, self.privacy, static.private, evaluated)
        return log, {**row, "epsilon": log.epsilon, "repaired": int(srv.repaired)}

    def _result(self, state: RunState, history: dict[str, np.ndarray],
                rejected: list[tuple[int, str, str]]) -> FedBNRResult:
        srv = state.server
        best = int(srv.best_round)
        if best == 0:
            warnings.warn("no evaluation gave finite statistics: the result holds the initial "
                          "kernels and the prior as last layer", RuntimeWarning, stacklevel=3)
        stopped = bool(srv.done) and int(srv.stale) >= self.patience
        _warn_not_finite((srv.best, srv.last_layer))
        _warn_unresolved(srv.best, np.asarray(state.masks).sum(axis=1), self.spec.num_features)
        plan = self._started(state)
        return FedBNRResult(history=history, client_names=plan.names, rejected=rejected,
                            spec=self.spec, kernel=self.kernel, last_layer=self.last_layer,
                            kernels=srv.best, layers=srv.last_layer, omega=srv.omega,
                            best_round=best or None,
                            rounds_to_convergence=int(srv.round) if stopped else None,
                            privacy=self._privacy_result(plan.static, state.log.method,
                                                         history, len(plan.names)))

    def _privacy_result(self, static: _Static, log: _Log, history: dict[str, np.ndarray],
                        K: int) -> dict[str, Any] | None:
        if self.privacy is None or static.private is None:
            return None
        private = static.private
        out = self.privacy.report(private.sigma,
                                  np.full(K, log.evaluations * private.per_evaluation))
        std2 = out["noise_std"] ** 2
        # each entry of a global layer's sums carries K clients' noise, a local layer's one
        out["stat_noise_var"] = {"global": K * std2, "local": std2}
        out["repaired"] = int(np.sum(history["repaired"]))
        return out

    # -- running -------------------------------------------------------------------------------

    def init(self, rng_key: Array, clients: Clients, *, validation: tuple | None = None,
             kd_data: tuple | None = None, num_rounds: int | None = None,
             runtime: Any = None) -> RunState:
        """Check the data and set up the run. ``validation=(X, y)``: the server's validation
        data (see the module doc); ``kd_data=(X, y)``: the server's distillation data (needed by
        ``kernel="kd"`` and used by no other); ``num_rounds``: the planned last round, which is
        evaluated in any case (``run`` passes its own; without it, only every ``eval_every``-th
        round forms the last layer)."""
        rng_key = check_key(rng_key)
        _check_clients(clients, self.spec.input_dim)
        final = 0 if num_rounds is None else check_rounds(num_rounds)
        validation = _check_server_data(validation, self.spec.input_dim, "validation")
        if self.kernel == "kd" and kd_data is None:
            raise ValueError("kernel='kd' needs kd_data=(X_kd, y_kd) held by the server")
        if self.kernel != "kd" and kd_data is not None:
            raise ValueError(f"kd_data is used only by kernel='kd', not {self.kernel!r}")
        kd_data = _check_server_data(kd_data, self.spec.input_dim, "kd_data")
        k_omega, k_init, k_run = jax.random.split(rng_key, 3)
        run_clients = clients.pooled() if self.kernel == "central" else clients
        state = super().init(rng_key, run_clients, keys=(k_omega, k_init), final_round=final,
                             kd_data=kd_data, validation=validation, runtime=runtime)
        return state._replace(rng_key=k_run)

    def run(self, rng_key: Array, clients: Clients, num_rounds: int, *,
            progress_bar: bool = True, validation: tuple | None = None,
            kd_data: tuple | None = None, runtime: Any = None) -> FedBNRResult:
        """Up to ``num_rounds`` rounds (fewer if early stopping ends phase 1); the last layer is
        formed at the latest at the last round."""
        num_rounds = check_rounds(num_rounds)
        state = self.init(rng_key, clients, validation=validation, kd_data=kd_data,
                          num_rounds=num_rounds, runtime=runtime)
        return self._loop(state, num_rounds, progress_bar, stop=self._phase_two)

    def _phase_two(self, rows: list[dict[str, Any]]) -> str | None:
        """The run's own early stopping: phase 1 over, the last layer formed."""
        if rows[-1]["phase"] != 2:
            return None
        return (f"early stopping: the validation RMSE did not improve in {self.patience} "
                f"evaluations (every {self.eval_every} rounds); the last layer was formed")


# -- a run's static part and accumulators ----------------------------------------------------


class _Private(NamedTuple):
    """A private run's calibration: the noise multiplier, and the releases each evaluation
    makes per client (1 with a shared kernel, else one per client's kernel)."""

    sigma: float
    per_evaluation: int


class _Static(NamedTuple):
    """FedBNR's part of a plan (``plan.static``): the bytes of one client's statistics, and a
    private run's calibration (None: not private)."""

    stats_bytes: int
    private: _Private | None = None


class _Log(NamedTuple):
    """FedBNR's accumulators (``state.log.method``): the evaluations so far and, in a private
    run, the epsilon each client has spent on them (None before the first round)."""

    evaluations: int = 0
    epsilon: float | None = None


def _calibrate(privacy: PrivateStatistics, per_evaluation: int, eval_every: int,
               final_round: int) -> _Private:
    """The noise multiplier for the evaluations a run of ``final_round`` rounds plans (every
    ``eval_every``-th round and the last)."""
    if privacy.epsilon is not None and final_round == 0:
        raise ValueError("privacy with a target epsilon calibrates the noise for the planned "
                         "evaluations: pass num_rounds to init (run does), or give "
                         "noise_multiplier instead")
    planned = final_round // eval_every + (final_round % eval_every != 0)
    return _Private(privacy.noise_multiplier_for(planned * per_evaluation), per_evaluation)


def _account(log: _Log, privacy: PrivateStatistics, private: _Private, evaluated: bool) -> _Log:
    """The accounting after a round: one more evaluation if it evaluated, and the epsilon
    spent (computed again only when the releases change)."""
    if not evaluated and log.epsilon is not None:
        return log
    evaluations = log.evaluations + evaluated
    spent = privacy.spent(private.sigma, evaluations * private.per_evaluation)
    return _Log(evaluations, spent)


# -- checks: every argument and array before any compiled code runs --------------------------


def _warn_not_finite(tree: Any) -> None:
    """A kernel or last layer that is not finite is said, never returned silently (NaN
    predictions surface much later, in a metric or a plot)."""
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    if all(np.all(np.isfinite(x)) for x in leaves if np.issubdtype(x.dtype, np.floating)):
        return
    dtype = jnp.result_type(float)
    hint = ("; this run computed in float32: numpyro.enable_x64() runs it in float64"
            if dtype == jnp.float32 else "")
    warnings.warn(f"FedBNR's kernels or last layer are not finite: its predictions will be NaN "
                  f"(a learning rate too large for the data, or data not standardised){hint}",
                  RuntimeWarning, stacklevel=4)



def _warn_unresolved(kernels: alg.BNRParams, sizes: np.ndarray, num_features: int) -> None:
    """Warn where the dtype cannot resolve the clients' objective at the learnt kernel: where
    the jitter a Cholesky factor of ``A = S / sigma^2 + I / lambda^2`` needs
    (:func:`fedppl.families.gaussian.jitter_floor`, ``10 eps tr(A)``; ``tr(S) = N_k`` for the
    unit-norm URK features) exceeds the prior precision ``1 / lambda^2``."""
    noise, scale = (np.asarray(x, np.float64) for x in (kernels.noise, kernels.prior_scale))
    eps = float(jnp.finfo(kernels.log_noise.dtype).eps)
    floor = 10 * eps * (float(sizes.max()) / noise**2 + num_features / scale**2)
    if not np.all(np.isfinite(floor)) or np.all(floor <= 1 / scale**2):
        return
    warnings.warn(f"FedBNR's kernel objective is not resolved in "
                  f"{jnp.dtype(kernels.log_noise.dtype).name} at the learnt noise "
                  f"{float(noise.min()):.3g} with up to {int(sizes.max())} points per client: "
                  f"the kernels may be far from a float64 run's; numpyro.enable_x64() runs it "
                  f"in float64", RuntimeWarning, stacklevel=4)


def _choice(value: Any, options: tuple[str, ...], name: str) -> str:
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _number(value: Any, name: str, positive: bool = True) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or (value <= 0 if positive else value < 0):
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {kind} finite number, got {value!r}")
    return float(value)


def _check_inputs(X: Any, input_dim: int, who: str) -> np.ndarray:
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[1] != input_dim:
        hint = " (one feature: X[:, None])" if X.ndim == 1 else ""
        raise ValueError(f"{who}: inputs must have shape (n, {input_dim}), got {X.shape}{hint}")
    _check_numbers(X, who, "inputs")
    return X


def _check_numbers(a: np.ndarray, who: str, what: str) -> None:
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise TypeError(f"{who}: {what} must be numbers, got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.complexfloating) or not np.all(np.isfinite(a)):
        raise ValueError(f"{who}: {what} must be finite real numbers")


def _check_xy(X: Any, y: Any, input_dim: int, who: str) -> tuple[np.ndarray, np.ndarray]:
    X, y = _check_inputs(X, input_dim, who), np.asarray(y)
    if y.ndim != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"{who}: targets must have shape ({X.shape[0]},), got {y.shape}")
    _check_numbers(y, who, "targets")
    if X.shape[0] == 0:
        raise ValueError(f"{who}: no data")
    return X, y


def _check_clients(clients: Any, input_dim: int) -> None:
    if not isinstance(clients, Clients):
        raise TypeError(f"clients must be a fedppl.Clients (see fedppl.partition), got "
                        f"{type(clients).__name__}")
    for name, data in zip(clients.names, clients.data, strict=True):
        if len(data) != 2:
            raise ValueError(f"{name}: FedBNR needs (X, y) on each client, got {len(data)} "
                             "arrays")
        _check_xy(*data, input_dim, name)


def _check_server_data(data: Any, input_dim: int, name: str) -> tuple[Array, Array] | None:
    if data is None:
        return None
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise TypeError(f"{name} must be a pair (X, y), got {type(data).__name__}")
    X, y = _check_xy(*data, input_dim, name)
    return jnp.asarray(X, float), jnp.asarray(y, float)
