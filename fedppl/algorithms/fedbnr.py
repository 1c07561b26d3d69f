"""FedBNR (federated Bayesian neural regression) as one trio of pure functions.

Phase 1 learns the kernel (URK weights, noise ``sigma`` and prior scale ``lambda``) by maximising
each client's log marginal likelihood (Eq. 18); the server combines the clients' kernels by
FedAvg (:mod:`fedppl.algorithms.fedavg`), then optionally distils them on a small server dataset
(Eq. 19, ``"kd"``), or keeps them apart (``"local"``; ``"central"`` is ``"local"`` on the pooled
data). Phase 2 is the exact Bayesian last layer from the clients' sufficient statistics
(:mod:`fedppl.algorithms.exact`).

Both phases are one trio; the phase lives in the server state. Every round the clients train
(phase 1). At an evaluation round (every ``eval_every`` rounds, and the planned last round) the
server asks the clients, through the trio's ``client_evaluate`` exchange, for their statistics
under the new kernels, forms both last layers from them (``global_``: every client's statistics
under each kernel; ``local``: each client's own) and scores them on its validation data. It keeps
the best-scoring kernels with their last layers (without validation data: the latest); once
``patience`` evaluations in a row have not improved, or the planned last round is evaluated,
``done`` is set: phase 2 has been reached, the kernels and the last layers are final and later
rounds change nothing.

Private statistics (``Settings.privacy``, a :class:`fedppl.algorithms.dp_statistics.Mechanism`): at
every evaluation each client clips its features and targets and adds Gaussian noise to each kernel's
statistics with its own round key (kept in :class:`ClientState`), so they leave it noised; the
server projects every summed scatter matrix onto the PSD cone and forms the last layers with the
noise in the projections weighed in their likelihood
(:func:`fedppl.algorithms.dp_statistics.noise_aware_posterior`); it records in
``ServerState.repaired`` how many eigenvalues it raised. The phase-1 kernels are not privatised.

Example (two clients, two rounds of FedAvg, the last layer at the planned last round)::

    >>> import jax, optax, fedppl
    >>> from fedppl.models.random_features import URKSpec, base_draws, init_urk
    >>> from fedppl.runtime import make_round
    >>> spec = URKSpec(1, feature_widths=(), shift_widths=(), num_samples=5)
    >>> X = jax.random.normal(jax.random.key(0), (40, 1)); y = jax.numpy.sin(X[:, 0])
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=2, seed=0)
    >>> trio = make_trio(Settings("avg", optax.adam(1e-2), local_steps=5, eval_every=5,
    ...                           patience=5))
    >>> params = init_params(init_urk(jax.random.key(1), spec))
    >>> server = init_server(params, base_draws(jax.random.key(2), spec), 1, num_clients=2,
    ...                      final_round=2)
    >>> cstate = init_clients(params, 2)
    >>> round_fn = make_round(trio, "synchronous")
    >>> for r in range(2):
    ...     server, cstate, msgs, ok = round_fn(server, cstate, clients.stacked, clients.mask,
    ...         jax.random.split(jax.random.key(r), 2), jax.numpy.ones(2, bool), None)
    >>> bool(server.done), server.last_layer.global_.nat1.shape   # one model, 10 features
    (True, (1, 10))
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import Array

from fedppl import trees
from fedppl.algorithms import dp_statistics, exact, fedavg
from fedppl.algorithms.trio import Trio
from fedppl.families import gaussian as g
from fedppl.models.random_features import URKParams, urk_features
from fedppl.optimise import minimise

__all__ = ["BNRParams", "Settings", "ServerState", "ClientState", "KernelMessage", "LastLayer",
           "KERNELS", "init_params", "init_server", "init_clients", "make_trio", "neg_log_ml",
           "client_stats", "last_layers", "private_last_layers", "predict", "kd_loss",
           "kd_server_update", "secure_summand", "secure_message"]

KERNELS = ("avg", "kd", "local", "central")


class BNRParams(NamedTuple):
    """Phase-1 parameters: the kernel network and the log noise / log prior scale."""

    kernel: URKParams
    log_noise: Array
    log_prior_scale: Array

    @property
    def noise(self) -> Array:
        return jnp.exp(self.log_noise)

    @property
    def prior_scale(self) -> Array:
        return jnp.exp(self.log_prior_scale)


class Settings(NamedTuple):
    """The algorithm's static choices (see :class:`fedppl.infer.bayesian_regression.FedBNR`)."""

    kernel: str
    optimizer: optax.GradientTransformation
    local_steps: int = 50
    kd_alpha: float = 5.0
    kd_steps: int = 50
    eval_every: int = 5
    patience: int = 5
    privacy: dp_statistics.Mechanism | None = None  # noised statistics (None: exact)

    @property
    def shared(self) -> bool:
        """One kernel for every client (FedAvg, KD), or each client its own."""
        return self.kernel in ("avg", "kd")


class LastLayer(NamedTuple):
    """Exact last layers: ``global_`` (M,) from every client's statistics under each of the M
    kernels, ``local`` (K,) from each client's own statistics under its kernel."""

    global_: g.FullGaussian
    local: g.FullGaussian


class ServerState(NamedTuple):
    """The server's state; ``done`` marks phase 2 (the kernels and last layers are final)."""

    kernels: BNRParams  # (M, ...) this round's kernels: M = 1 when shared, else one per client
    best: BNRParams  # (M, ...) the kernels the last layers belong to
    last_layer: LastLayer
    best_score: Array  # validation RMSE of `best` (inf before any evaluation)
    score: Array  # this round's validation RMSE (NaN when not evaluated or no validation data)
    stale: Array  # evaluations since the last improvement
    best_round: Array  # the round `best` comes from (0: none yet)
    round: Array
    final_round: Array  # the planned last round, evaluated in any case (0: none)
    evaluated: Array  # whether this round was an evaluation round
    done: Array
    omega: Array  # the fixed base draws, shared at set-up
    kd_data: tuple[Array, Array] | None  # the server's own data ("kd")
    validation: tuple[Array, Array] | None  # the server's validation data
    # eigenvalues raised to zero in this evaluation's summed scatter matrices (private runs)
    repaired: Array | None = None


class ClientState(NamedTuple):
    """A client's own kernel (``"local"``/``"central"``) or its latest local result (shared),
    and (private runs) the raw key its noise for this round's statistics comes from."""

    params: BNRParams
    noise_key: Array | None = None


class KernelMessage(NamedTuple):
    """What a client sends each round: its kernel after the local steps, and its log marginal
    likelihood under the kernel it started from (the phase-1 objective, a scalar)."""

    params: BNRParams
    log_ml: Array


# -- the objective and the statistics --------------------------------------------------------


def init_params(kernel: URKParams, noise: float = 0.3, prior_scale: float = 1.0) -> BNRParams:
    return BNRParams(kernel, jnp.log(jnp.asarray(noise)), jnp.log(jnp.asarray(prior_scale)))


def neg_log_ml(params: BNRParams, data: tuple, mask: Array, key: Array | None = None, *,
               omega: Array) -> Array:
    """Minus the client's log marginal likelihood (Eq. 18) per data point; ``data = (X, y)``
    (from the data themselves: :func:`fedppl.algorithms.exact.data_log_marginal_likelihood`)."""
    X, y = data
    lml = exact.data_log_marginal_likelihood(urk_features(params.kernel, omega, X), y,
                                             params.noise, params.prior_scale, mask)
    return -lml / jnp.maximum(jnp.sum(mask), 1.0)


def client_stats(kernel: URKParams, omega: Array, X: Array, y: Array, mask: Array
                 ) -> exact.Stats:
    """Phase 2 on a client: the statistics of its data under a kernel."""
    return exact.client_stats(urk_features(kernel, omega, X), y, mask)


def kd_loss(params: BNRParams, client_kernels: URKParams, omega: Array, X_kd: Array, y_kd: Array,
            alpha: float) -> Array:
    """Eq. 19 as a loss to minimise: the server data's per-datum negative log marginal
    likelihood plus ``alpha`` times the mean squared difference between the global URK Gram
    matrix on ``X_kd`` and the average of the clients' Gram matrices."""
    ones = jnp.ones(X_kd.shape[0])
    fit = neg_log_ml(params, (X_kd, y_kd), ones, omega=omega)
    Phi = urk_features(params.kernel, omega, X_kd)

    def gram(kernel):
        P = urk_features(kernel, omega, X_kd)
        return P @ P.T

    target = jnp.mean(jax.vmap(gram)(client_kernels), axis=0)
    return fit + alpha * jnp.mean((Phi @ Phi.T - target) ** 2)


def kd_server_update(start: BNRParams, client_params: BNRParams, omega: Array, X_kd: Array,
                     y_kd: Array, alpha: float, optimizer: optax.GradientTransformation,
                     steps: int) -> BNRParams:
    """Distil the clients' kernels into the global one, starting from ``start`` (the average)."""
    target = jax.lax.stop_gradient(client_params.kernel)
    loss = lambda p, _: kd_loss(p, target, omega, X_kd, y_kd, alpha)  # noqa: E731
    return minimise(loss, start, optimizer, steps)[0]


# -- states ----------------------------------------------------------------------------------


def _strong(tree: Any) -> Any:
    """Without JAX's weak types, so that compiled rounds see one input type throughout."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.result_type(x)), tree)


def _where(flag: Array, a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(lambda x, y: jnp.where(flag, x, y), a, b)


def _prior_layers(params: BNRParams, num_models: int, num_clients: int, dim: int) -> LastLayer:
    """The prior in the place of the last layers (before the first evaluation)."""
    scale = jnp.exp(params.log_prior_scale)
    prior = g.FullGaussian(jnp.zeros(dim), jnp.eye(dim) / scale**2)
    return LastLayer(trees.broadcast(prior, num_models), trees.broadcast(prior, num_clients))


def init_server(params: BNRParams, omega: Array, num_models: int, *, num_clients: int | None = None,
                final_round: int = 0, kd_data: tuple | None = None,
                validation: tuple | None = None) -> ServerState:
    """The server's first state: ``num_models`` copies of ``params`` (1 when shared, else K)."""
    num_clients = num_models if num_clients is None else num_clients
    params = _strong(params)
    kernels = trees.broadcast(params, num_models)
    zero, dtype = jnp.asarray(0, int), params.log_noise.dtype
    return ServerState(kernels, kernels,
                       _prior_layers(params, num_models, num_clients, 2 * omega.shape[0]),
                       jnp.asarray(jnp.inf, dtype), jnp.asarray(jnp.nan, dtype), zero, zero, zero,
                       jnp.asarray(final_round, int), jnp.asarray(False), jnp.asarray(False),
                       omega, kd_data, validation, zero)


def init_clients(params: BNRParams, num_clients: int, private: bool = False) -> ClientState:
    """The clients' first states (``private``: with a placeholder noise key each)."""
    keys = jnp.zeros((num_clients, *_raw_key(jax.random.key(0)).shape), jnp.uint32)
    return ClientState(trees.broadcast(_strong(params), num_clients), keys if private else None)


def _raw_key(key: Array) -> Array:
    """A key as raw ``uint32`` data (the form a client state keeps)."""
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


# -- phase 2: last layers, predictions, scores -----------------------------------------------


def _layer_stats(stats: exact.Stats, shared: bool) -> tuple[exact.Stats, exact.Stats, Array]:
    """The statistics behind each last layer: every client's summed under each kernel (M, ...),
    each client's own under its kernel (K, ...), and which kernel that is (K,)."""
    K = stats.count.shape[0]
    over_clients = jax.tree_util.tree_map(lambda x: jnp.swapaxes(x, 0, 1), stats)
    total = jax.vmap(exact.add_up)(over_clients)  # (M, ...): client 0 first, as on the host
    which = jnp.zeros(K, int) if shared else jnp.arange(K)
    own = trees.index(stats, (jnp.arange(K), which))
    return total, own, which


def _layers(total: exact.Stats, own: exact.Stats, which: Array, kernels: BNRParams,
            noise_var: tuple[Array | float, Array | float] | None = None) -> LastLayer:
    """The last layers; ``noise_var``: the privacy noise's variance on each entry of the
    summed and of each client's own statistics (None: exact statistics)."""
    mine = trees.index(kernels, which)
    if noise_var is None:
        glob = jax.vmap(exact.posterior)(total, kernels.noise, kernels.prior_scale)
        return LastLayer(glob, jax.vmap(exact.posterior)(own, mine.noise, mine.prior_scale))
    post = jax.vmap(dp_statistics.noise_aware_posterior, in_axes=(0, 0, 0, None))
    return LastLayer(post(total, kernels.noise, kernels.prior_scale, noise_var[0]),
                     post(own, mine.noise, mine.prior_scale, noise_var[1]))


def last_layers(stats: exact.Stats, kernels: BNRParams, shared: bool) -> LastLayer:
    """Both last layers from ``stats`` of shape ``(K, M, ...)`` (client k under kernel m)."""
    return _layers(*_layer_stats(stats, shared), kernels)


def private_last_layers(stats: exact.Stats, kernels: BNRParams, shared: bool,
                        noise_std: Array | float) -> tuple[LastLayer, Array]:
    """:func:`last_layers` from noised statistics (``noise_std`` on each entry of each client's):
    every summed scatter matrix (and each client's own) projected onto the PSD cone first
    (:func:`fedppl.algorithms.dp_statistics.repair_scatter`), the noise in the projections
    weighed in the likelihood (:func:`fedppl.algorithms.dp_statistics.noise_aware_posterior`);
    also returns how many eigenvalues were raised."""
    total, own, which = _layer_stats(stats, shared)
    S_total, n_total = dp_statistics.repair_scatter(total.scatter)
    S_own, n_own = dp_statistics.repair_scatter(own.scatter)
    K = stats.count.shape[0]
    layer = _layers(total._replace(scatter=S_total), own._replace(scatter=S_own), which, kernels,
                    (K * noise_std**2, noise_std**2))
    return layer, (jnp.sum(n_total) + jnp.sum(n_own)).astype(int)


def model_kernels(kernels: BNRParams, num_clients: int, shared: bool, last_layer: str
                  ) -> BNRParams:
    """The kernel of each model of a last layer: one per kernel (global), one per client."""
    if last_layer == "global":
        return kernels
    return trees.index(kernels, jnp.zeros(num_clients, int) if shared else jnp.arange(num_clients))


def predict(kernels: BNRParams, posteriors: g.FullGaussian, omega: Array, X: Array,
            stat_noise_var: Array | None = None) -> tuple[Array, Array]:
    """Predictive means and variances (noise included), ``(models, n)`` each;
    ``stat_noise_var`` (models,): the variance of the privacy noise on each entry of each
    model's summed statistics: the variances then include the scatter noise's effect on the
    mean of a private run's posteriors
    (:func:`fedppl.algorithms.dp_statistics.predict_noise_aware`)."""
    def one(p, post):
        return exact.predict(post, urk_features(p.kernel, omega, X), p.noise)

    if stat_noise_var is None:
        return jax.vmap(one)(kernels, posteriors)

    def noisy(p, post, tau2):
        return dp_statistics.predict_noise_aware(post, urk_features(p.kernel, omega, X),
                                                 p.noise, p.prior_scale, tau2)

    return jax.vmap(noisy)(kernels, posteriors, stat_noise_var)


def _score(layer: LastLayer, kernels: BNRParams, settings: Settings, last_layer: str,
           omega: Array, validation: tuple | None) -> Array:
    """Validation RMSE of the chosen last layer, averaged over its models (NaN: no data)."""
    if validation is None:
        return jnp.asarray(jnp.nan)
    post = layer.global_ if last_layer == "global" else layer.local
    models = model_kernels(kernels, post.nat1.shape[0], settings.shared, last_layer)
    mean, _ = predict(models, post, omega, validation[0])
    return jnp.mean(jnp.sqrt(jnp.mean((mean - validation[1]) ** 2, axis=1)))


# -- the trio --------------------------------------------------------------------------------


def make_trio(settings: Settings, last_layer: str = "global") -> Trio:
    """FedBNR's trio; ``last_layer`` (``"global"`` or ``"local"``) is the one scored on the
    validation data (both are formed at every evaluation)."""
    return Trio(partial(_client_update, settings), partial(_server_update, settings, last_layer),
                client_evaluate=partial(_client_evaluate, settings.privacy))


def _client_update(settings: Settings, server: ServerState, client: ClientState, data: tuple,
                   mask: Array, rng_key: Array, index: Array
                   ) -> tuple[KernelMessage, ClientState]:
    start = trees.index(server.kernels, 0) if settings.shared else client.params
    loss = partial(neg_log_ml, omega=server.omega)

    def train(_):
        new, losses = fedavg.local_train(start, loss, data, mask, settings.optimizer,
                                         settings.local_steps, rng_key)
        return new, -losses[0] * jnp.sum(mask)

    def rest(_):  # phase 2: nothing left to learn
        return start, jnp.full((), jnp.nan, jnp.result_type(float))

    new, log_ml = jax.lax.cond(server.done, rest, train, None)
    noise_key = None if settings.privacy is None else _raw_key(jax.random.fold_in(rng_key, 1))
    return KernelMessage(new, log_ml), ClientState(new, noise_key)


def _client_evaluate(privacy: dp_statistics.Mechanism | None, candidate: tuple[BNRParams, Array],
                     client: ClientState, data: tuple, mask: Array) -> exact.Stats:
    """The evaluation exchange: this client's statistics under each candidate kernel (noised
    with the client's own key when ``privacy`` is set)."""
    kernels, omega = candidate
    X, y = data
    if privacy is None:
        return jax.vmap(lambda p: client_stats(p.kernel, omega, X, y, mask))(kernels)
    if client.noise_key is None:
        raise ValueError("private statistics need the clients' noise keys: "
                         "init_clients(..., private=True)")
    keys = jax.random.split(client.noise_key, kernels.log_noise.shape[0])

    def one(p, key):
        return dp_statistics.private_stats(urk_features(p.kernel, omega, X), y, mask, privacy,
                                           key)

    return jax.vmap(one)(kernels, keys)


# -- secure aggregation: the server gets only the sum of the messages ------------------------


def secure_summand(server: ServerState, msg: KernelMessage) -> tuple[KernelMessage, Array]:
    """What a client adds into a secure sum (SecAgg+, :mod:`fedppl.runtime.secagg`) in place of
    ``msg``, and whether the server would accept ``msg`` (finite kernel parameters: FedAvg's
    check), checked by the client, as the server sees only the sum. In phase 2 the server
    ignores the messages (and ``log_ml`` is NaN): zeros, accepted. Secure aggregation serves
    the shared ``"avg"`` kernel only: ``"kd"`` distils each client's kernel, ``"local"`` keeps
    them apart."""
    finite = fedavg.all_finite(trees.broadcast(msg.params, 1))[0]
    zero = jax.tree_util.tree_map(jnp.zeros_like, msg)
    return _where(server.done, zero, msg), server.done | finite


def secure_message(server: ServerState, total: KernelMessage, n: int) -> KernelMessage:
    """One of ``n`` equal messages that the server update folds as it folds the ``n`` messages
    whose summands (:func:`secure_summand`) add to ``total``: their mean (FedAvg's uniform
    weights; the rows' summed ``log_ml`` is the total's)."""
    return jax.tree_util.tree_map(lambda x: x / n, total)


def _aggregate(settings: Settings, server: ServerState, params: BNRParams, received: Array
               ) -> tuple[BNRParams, Array]:
    """This round's kernels from the clients' and which clients' kernels were taken."""
    if not settings.shared:
        return params, received
    state, ok = fedavg.server_update(fedavg.init(trees.index(server.kernels, 0)), params,
                                     received=received)
    kernel = state.params
    if settings.kernel == "kd":
        if server.kd_data is None:
            raise ValueError("kernel='kd' needs the server's kd_data")
        X_kd, y_kd = server.kd_data
        kernel = kd_server_update(kernel, params, server.omega, X_kd, y_kd, settings.kd_alpha,
                                  settings.optimizer, settings.kd_steps)
    return trees.broadcast(kernel, 1), ok


def _server_update(settings: Settings, last_layer: str, server: ServerState,
                   msgs: KernelMessage, index: Array, received: Array, rng_key: Array,
                   evaluate: Any) -> tuple[ServerState, Array]:
    if evaluate is None:
        raise ValueError("FedBNR needs the evaluation exchange: run it synchronously")
    kernels, ok = jax.lax.cond(server.done, lambda: (server.kernels, received & False),
                               lambda: _aggregate(settings, server, msgs.params, received))
    rnd = server.round + jnp.where(server.done, 0, 1)
    due = (rnd % settings.eval_every == 0) | (rnd == server.final_round)
    now = ~server.done & due

    def assess():
        stats = evaluate((kernels, server.omega))
        if settings.privacy is None:
            layer, repaired = last_layers(stats, kernels, settings.shared), jnp.asarray(0, int)
        else:
            layer, repaired = private_last_layers(stats, kernels, settings.shared,
                                                  settings.privacy.noise_std)
        score = _score(layer, kernels, settings, last_layer, server.omega, server.validation)
        usable = exact.all_finite(stats)
        return layer, jnp.where(usable, score, jnp.inf), usable, repaired

    layer, score, usable, repaired = jax.lax.cond(
        now, assess, lambda: (server.last_layer, jnp.asarray(jnp.nan, server.score.dtype),
                              jnp.asarray(False), jnp.asarray(0, int)))
    better = now & usable & ((server.validation is None) | (score < server.best_score))
    stale = jnp.where(now, jnp.where(better, 0, server.stale + 1), server.stale)
    stop = now & ((stale >= settings.patience) | (rnd == server.final_round))
    new = server._replace(
        kernels=kernels, best=_where(better, kernels, server.best),
        last_layer=_where(better, layer, server.last_layer),
        best_score=jnp.where(better, score, server.best_score),
        score=jnp.where(now, score, jnp.nan), stale=stale,
        best_round=jnp.where(better, rnd, server.best_round), round=rnd, evaluated=now,
        done=server.done | stop, repaired=repaired)
    return new, ok
