"""``FedBNR``: a global random-feature GP learned across clients (Alg. 1 of the FedBNR paper).

Phase 1 learns the kernel; phase 2 fits the Bayesian last layer exactly from the clients'
sufficient statistics. The paper's variants and ablations are the combinations of

* ``kernel``: ``"avg"`` (FedAvg), ``"kd"`` (knowledge distillation on server data), ``"local"``
  (each client its own kernel) or ``"central"`` (pooled data: the reference);
* ``last_layer``: ``"global"`` (exact aggregation over all clients) or ``"local"`` (each client's
  own data only).

FedBNR is ``avg + global``, FedBNR-KD ``kd + global``; models that stay per client are scored as
the average over clients, as in the paper.

Example::

    >>> spec = URKSpec(input_dim=X.shape[1])
    >>> fit = FedBNR(spec, kernel="avg").fit(jax.random.key(0), clients, validation=(Xv, yv))
    >>> mean, var = fit.predict(X_test)            # (models, n): one model for avg + global
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import Array
from tqdm.auto import tqdm

from fedppl.algorithms import exact, fedavg
from fedppl.algorithms import fedbnr as alg
from fedppl.clients import Clients
from fedppl.families import gaussian as g
from fedppl.models.random_features import URKSpec, base_draws, init_urk, urk_features

__all__ = ["FedBNR", "FedBNRFit", "KERNELS", "LAST_LAYERS"]

KERNELS = ("avg", "kd", "local", "central")
LAST_LAYERS = ("global", "local")


@dataclass
class FedBNRFit:
    """Learnt kernels and last layers, one per model (``M = 1`` for a global model, else K).

    ``messages`` holds the phase-2 statistics the clients sent for the first model, for
    inspection; ``history`` the validation RMSE at each evaluation.
    """

    params: alg.BNRParams  # leading axis M
    posteriors: g.FullGaussian  # leading axis M
    omega: Array
    history: dict[str, list] = field(default_factory=dict)
    messages: list[exact.Stats] = field(default_factory=list)

    @property
    def num_models(self) -> int:
        return self.posteriors.nat1.shape[0]

    def predict(self, X: Array) -> tuple[Array, Array]:
        """Predictive means and variances (noise included), each of shape ``(M, n)``."""
        return _predict(self.params, self.posteriors, self.omega, jnp.asarray(X))


@jax.jit
def _predict(params, posteriors, omega, X):
    def one(p, post):
        return exact.predict(post, urk_features(p.kernel, omega, X), p.noise)

    return jax.vmap(one)(params, posteriors)


class FedBNR:
    """Two-phase federated Bayesian neural regression.

    :param spec: the URK architecture.
    :param kernel: ``"avg"``, ``"kd"``, ``"local"`` or ``"central"`` (phase 1).
    :param last_layer: ``"global"`` or ``"local"`` (phase 2).
    :param optimizer: optax optimiser for the local (and distillation) steps.
    :param rounds: aggregation rounds; ``local_steps`` full-batch steps per round.
    :param kd_alpha, kd_steps: weight of the kernel-matching term and server steps (``"kd"``).
    :param eval_every, patience: validation RMSE every ``eval_every`` rounds; stop after
        ``patience`` evaluations without improvement; the best evaluated parameters are kept.
    :param noise, prior_scale: initial sigma and lambda (standardised units).
    """

    def __init__(self, spec: URKSpec, kernel: str = "avg", last_layer: str = "global",
                 optimizer: optax.GradientTransformation | None = None, rounds: int = 100,
                 local_steps: int = 50, kd_alpha: float = 5.0, kd_steps: int = 50,
                 eval_every: int = 5, patience: int = 5, noise: float = 0.3,
                 prior_scale: float = 1.0):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if last_layer not in LAST_LAYERS:
            raise ValueError(f"last_layer must be one of {LAST_LAYERS}, got {last_layer!r}")
        self.spec, self.kernel, self.last_layer = spec, kernel, last_layer
        self.optimizer = optimizer if optimizer is not None else optax.adam(1e-2)
        self.rounds, self.local_steps = rounds, local_steps
        self.kd_alpha, self.kd_steps = kd_alpha, kd_steps
        self.eval_every, self.patience = eval_every, patience
        self.noise, self.prior_scale = noise, prior_scale

    # -- phase 1 -----------------------------------------------------------------------------

    def _round_fn(self, omega: Array, kd_data: tuple | None):
        loss = partial(alg.neg_log_ml, omega=omega)
        train = partial(fedavg.local_train, loss_fn=loss, optimizer=self.optimizer,
                        steps=self.local_steps)
        shared = self.kernel in ("avg", "kd")
        vtrain = jax.vmap(lambda p, d, m, k: train(p, data=d, mask=m, rng_key=k)[0],
                          in_axes=(None if shared else 0, 0, 0, 0))

        @jax.jit
        def round_fn(params, data, masks, key):
            keys = jax.random.split(key, masks.shape[0])
            new = vtrain(params, data, masks, keys)
            if not shared:  # local kernels (or the one pooled "client" of central)
                return new
            state, _ = fedavg.server_update(fedavg.init(params), new)
            if self.kernel == "avg":
                return state.params
            return alg.kd_server_update(state.params, new, omega, *kd_data, self.kd_alpha,
                                        self.optimizer, self.kd_steps)

        return round_fn

    def fit(self, rng_key: Array, clients: Clients, validation: tuple[Array, Array],
            kd_data: tuple[Array, Array] | None = None, progress_bar: bool = False) -> FedBNRFit:
        """Learn the kernel, then the last layer; standardised inputs and targets expected."""
        params, omega, history = self.learn_kernel(rng_key, clients, validation, kd_data,
                                                   progress_bar)
        fit = self.last_layer_fit(params, omega, clients)
        fit.history = history
        return fit

    def learn_kernel(self, rng_key: Array, clients: Clients, validation: tuple[Array, Array],
                     kd_data: tuple[Array, Array] | None = None, progress_bar: bool = False
                     ) -> tuple[alg.BNRParams, Array, dict]:
        """Phase 1 with early stopping on validation RMSE (scored with this object's last
        layer); returns the best parameters, the random draws and the validation history."""
        if self.kernel == "kd" and kd_data is None:
            raise ValueError("kernel='kd' needs kd_data=(X_kd, y_kd) held by the server")
        k_omega, k_init, k_run = jax.random.split(rng_key, 3)
        omega = base_draws(k_omega, self.spec)
        params = alg.init_params(init_urk(k_init, self.spec), self.noise, self.prior_scale)
        train_clients = clients.pooled() if self.kernel == "central" else clients
        data, masks = train_clients.stacked, train_clients.mask
        if self.kernel in ("local", "central"):
            params = jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(x, (train_clients.num_clients,) + x.shape), params)
        kd = None if kd_data is None else tuple(jnp.asarray(a) for a in kd_data)
        round_fn = self._round_fn(omega, kd)
        best, best_rmse, stale, history = params, np.inf, 0, {"round": [], "val_rmse": []}
        for r in tqdm(range(1, self.rounds + 1), disable=not progress_bar, leave=False,
                      desc=f"FedBNR {self.kernel}+{self.last_layer}"):
            k_run, key = jax.random.split(k_run)
            params = round_fn(params, data, masks, key)
            if r % self.eval_every and r != self.rounds:
                continue
            rmse = self._validation_rmse(params, omega, clients, validation)
            history["round"].append(r)
            history["val_rmse"].append(rmse)
            if rmse < best_rmse:
                best, best_rmse, stale = params, rmse, 0
            else:
                stale += 1
                if stale >= self.patience:
                    break
        return best, omega, history

    def _validation_rmse(self, params, omega, clients, validation) -> float:
        try:
            fit = self.last_layer_fit(params, omega, clients)
        except ValueError as e:  # a diverged kernel: count it as no improvement
            warnings.warn(f"validation skipped: {e}", RuntimeWarning, stacklevel=3)
            return np.inf
        mean, _ = fit.predict(validation[0])
        return float(np.mean(np.sqrt(np.mean((np.asarray(mean) - validation[1]) ** 2, axis=1))))

    # -- phase 2 -----------------------------------------------------------------------------

    def last_layer_fit(self, params: alg.BNRParams, omega: Array, clients: Clients,
                       last_layer: str | None = None) -> FedBNRFit:
        """Phase 2: exact last layer(s) from the clients' statistics under the learnt kernel(s);
        ``last_layer`` overrides this object's choice (to score both from one kernel)."""
        last_layer = self.last_layer if last_layer is None else last_layer
        if last_layer not in LAST_LAYERS:
            raise ValueError(f"last_layer must be one of {LAST_LAYERS}, got {last_layer!r}")
        data, masks = clients.stacked, clients.mask
        per_model = self.kernel == "local"
        if self.kernel in ("avg", "kd"):  # one shared kernel: a model axis of one
            params = jax.tree_util.tree_map(lambda x: x[None], params)
        stats = _stats_all(params.kernel, omega, data, masks)  # (M, K, ...)
        K = clients.num_clients
        posts, messages = [], []
        for m in range(stats.count.shape[0]):
            msgs = [exact.Stats(stats.scatter[m, k], stats.proj[m, k], stats.count[m, k])
                    for k in range(K)]
            p_m = jax.tree_util.tree_map(lambda x: x[m], params)
            if last_layer == "global":
                posts.append(exact.posterior(exact.aggregate(msgs, clients.names), p_m.noise,
                                             p_m.prior_scale))
            else:
                own = [m] if per_model else range(K)
                for k in own:
                    posts.append(exact.posterior(exact.aggregate([msgs[k]], [clients.names[k]]),
                                                 p_m.noise, p_m.prior_scale))
            if m == 0:
                messages = msgs
        if not per_model and last_layer == "local":
            params = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x[:1], (K,) + x.shape[1:]),
                                            params)
        posteriors = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *posts)
        return FedBNRFit(params, posteriors, omega, messages=messages)


@jax.jit
def _stats_all(kernels, omega, data, masks) -> exact.Stats:
    """Statistics of every client under every kernel: leaves of shape ``(M, K, ...)``."""
    X, y = data

    def under(kernel):
        return jax.vmap(alg.client_message, (None, None, 0, 0, 0))(kernel, omega, X, y, masks)

    return jax.vmap(under)(kernels)
