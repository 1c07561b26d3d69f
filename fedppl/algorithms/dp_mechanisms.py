"""DP-PVI's mechanisms (:mod:`fedppl.algorithms.dp_pvi` holds the settings users give and the
accounting): each record's gradient and its clipping, the noise, DP-SGD's private gradient, and
the local-averaging and virtual-parties solvers, with the message a client sends when its noise
is distributed over a secure sum (:class:`NoisyMessage`). Pure functions and ``NamedTuple``
solvers that :class:`~fedppl.algorithms.pvi.VariationalSolver` and PVI's trio call.

    >>> import jax.numpy as jnp
    >>> tree = {"a": jnp.array([[3.0, 4.0], [0.3, 0.4]])}   # two records' gradients
    >>> [round(float(jnp.linalg.norm(row)), 6) for row in clip_records(tree, 1.0)["a"]]
    [1.0, 0.5]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import Array

from fedppl.algorithms.natural_gradient import LocalResult, log_lik_fn
from fedppl.algorithms.pvi import STEP_SIZES
from fedppl.families import gaussian as g
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.optimise import minimise

__all__ = ["DPSGD", "LocalAveragingSolver", "VirtualPartiesSolver", "NoisyMessage",
           "clip_records", "record_gradients", "shard_labels"]


# -- per-record gradients, clipping, noise ------------------------------------------------------


def record_gradients(model: Callable, guide: PVIGuide, params: Any, eps: Array, data: tuple,
                     mask: Array) -> Any:
    """Each record's gradient of its expected log-likelihood ``mean_s log p(y_n | theta_s)``,
    ``theta_s = mean + scale * eps_s``, with respect to the guide's parameters: a pytree whose
    leaves have the records on axis 0 (``vmap`` over records; a padded record's is zero)."""

    def one(p, row, m):
        mean, tril = guide.mean_and_tril(p)
        theta = mean + (eps * tril if guide.diag else eps @ tril.T)
        log_lik: Callable[..., Array] = log_lik_fn(model, guide, tuple(a[None] for a in row),
                                                   m[None])
        return jnp.mean(jax.vmap(log_lik)(theta))

    return jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, data, mask)


def clip_records(tree: Any, clip: float) -> Any:
    """Scale each record's slice (axis 0 of every leaf) to L2 norm at most ``clip`` over the
    whole pytree; ``clip = inf`` leaves it as it is."""
    leaves = jax.tree_util.tree_leaves(tree)
    sq = sum(jnp.sum(x.reshape(x.shape[0], -1) ** 2, axis=1) for x in leaves)
    norm = jnp.sqrt(sq)
    factor = jnp.minimum(1.0, clip / jnp.maximum(norm, jnp.finfo(norm.dtype).tiny))
    return jax.tree_util.tree_map(
        lambda x: x * factor.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), tree)


def _noise(key: Array, tree: Any, std: float | Array) -> Any:
    """``tree`` plus independent ``N(0, std^2)`` noise on every entry (nothing added at 0)."""
    if isinstance(std, float) and std == 0.0:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        x + std * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys,
                                                                       strict=True)])


def _gaussian_noise(key: Array, t: g.Gaussian, std: float) -> g.Gaussian:
    """A Gaussian factor plus ``N(0, std^2)`` noise on each of its free natural parameters: a
    full precision gets noise on its upper triangle, mirrored (it stays symmetric, and the
    upper triangle's norm is at most the matrix's, so the clipping bound still holds)."""
    if std == 0.0:
        return t
    k1, k2 = jax.random.split(key)
    nat1 = t.nat1 + std * jax.random.normal(k1, t.nat1.shape, t.nat1.dtype)
    z = std * jax.random.normal(k2, t.prec.shape, t.prec.dtype)
    if isinstance(t, g.FullGaussian):
        upper = jnp.triu(z)
        z = upper + jnp.swapaxes(jnp.triu(z, 1), -1, -2)
    return type(t)(nat1, t.prec + z)


class DPSGD(NamedTuple):
    """The private gradient of a client's local free energy, for
    :class:`~fedppl.algorithms.pvi.VariationalSolver`'s ``gradient``: exact gradient of the
    KL to the cavity minus the scaled, noised sum of the sampled records' clipped gradients.
    The draws ``eps`` come from the step's key exactly as the non-private solver draws them,
    so with no noise, no clipping and every record sampled the steps are the same."""

    model: Callable
    guide: PVIGuide
    num_particles: int
    clip: float
    noise_multiplier: float
    sampling_rate: float = 1.0
    batch_size: int | None = None

    def sample(self, key: Array, mask: Array) -> tuple[Array, Array]:
        """Weights of this step's records (1 for a sampled one) and the sum's scale-up."""
        if self.batch_size is not None:
            u = jnp.where(mask, jax.random.uniform(key, mask.shape), jnp.inf)
            chosen = jnp.zeros(mask.shape, bool).at[jnp.argsort(u)[:self.batch_size]].set(True)
            return (chosen & mask).astype(float), jnp.sum(mask) / self.batch_size
        if self.sampling_rate == 1.0:
            return mask.astype(float), jnp.asarray(1.0)
        pick = jax.random.bernoulli(key, self.sampling_rate, mask.shape)
        return (pick & mask).astype(float), jnp.asarray(1.0 / self.sampling_rate)

    def __call__(self, loss: Callable, q_cavity: g.Gaussian, data: tuple, mask: Array
                 ) -> Callable[[Any, Array], tuple[Array, Any]]:
        guide = self.guide
        cav_mean, _ = g.to_moments(q_cavity)

        def kl(params):
            mean, tril = guide.mean_and_tril(params)
            return g.kl_from_moments(mean, tril, q_cavity, cav_mean)

        def value_and_grad(params, key):
            mean = params["pvi_loc"]
            eps = jax.random.normal(key, (self.num_particles, mean.shape[-1]), dtype=mean.dtype)
            value, kl_grad = jax.value_and_grad(kl)(params)
            total, up = self.private_sum(params, eps, key, data, mask)
            grads = jax.tree_util.tree_map(lambda a, b: a - up.astype(b.dtype) * b, kl_grad,
                                           total)
            return value, grads

        return value_and_grad

    def private_sum(self, params: Any, eps: Array, key: Array, data: tuple, mask: Array
                    ) -> tuple[Any, Array]:
        """The step's mechanism: the sampled records' clipped gradients summed, plus
        ``N(0, (noise_multiplier * clip)^2)`` on each coordinate (sampling and noise keyed by
        ``key``), and the scale-up that makes it an estimate of the full sum."""
        per = clip_records(record_gradients(self.model, self.guide, params, eps, data, mask),
                           self.clip)
        w, up = self.sample(jax.random.fold_in(key, 1), mask)
        total = jax.tree_util.tree_map(lambda x: jnp.tensordot(w.astype(x.dtype), x, 1), per)
        std = 0.0 if self.noise_multiplier == 0.0 else self.noise_multiplier * self.clip
        return _noise(jax.random.fold_in(key, 2), total, std), up


def shard_labels(num_rows: int, shards: int) -> Array:
    """Each record's shard (or virtual party): a label drawn once per record position,
    independent of the data, the same in every round."""
    return jax.random.randint(jax.random.key(0x5EED), (num_rows,), 0, shards)


def _fit(model: Callable, guide: PVIGuide, optimizer: optax.GradientTransformation, steps: int,
         num_particles: int, q_cavity: g.Gaussian, start: Any, data: tuple, mask: Array,
         weight: float, key: Array) -> Any:
    """``steps`` optax steps on ``KL(q || q_cavity) - weight * E_q[log p(y_mask | theta)]``
    from the guide's parameters ``start``, ``num_particles`` fresh draws per step."""
    cav_mean, _ = g.to_moments(q_cavity)
    lik: Callable[..., Array] = log_lik_fn(model, guide, data, mask)

    def loss(params, k):
        mean, tril = guide.mean_and_tril(params)
        e = jax.random.normal(k, (num_particles, mean.shape[-1]), dtype=mean.dtype)
        theta = mean + (e * tril if guide.diag else e @ tril.T)
        ell = jnp.mean(jax.vmap(lik)(theta))
        return g.kl_from_moments(mean, tril, q_cavity, cav_mean) - weight * ell

    return minimise(loss, start, optimizer, steps, key).params


class LocalAveragingSolver(NamedTuple):
    """Local averaging (see the module's text): ``shards`` fits vmapped, clipped, averaged and
    noised in the guide's parameters. Each shard runs ``steps`` optax steps with
    ``num_particles`` fresh draws per step."""

    model: Callable
    guide: PVIGuide
    optimizer: optax.GradientTransformation
    steps: int
    num_particles: int
    clip: float
    noise_multiplier: float
    shards: int

    def changes(self, q_cavity: g.Gaussian, q: g.Gaussian, data: tuple, mask: Array,
                key: Array) -> Any:
        """Each shard's change in the guide's parameters from ``q`` (stacked on axis 0): the
        shard's records' likelihood, weighted by ``shards`` so that the shard stands in for the
        whole client, against the KL to the cavity. The weight is the public ``shards``, not the
        client's size over the shard's: one record then moves its own shard's fit only."""
        M = self.shards
        label = shard_labels(mask.shape[0], M)
        start = self.guide.params_from(q)

        def fit(j, k_fit):
            own = mask & (label == j)
            params = _fit(self.model, self.guide, self.optimizer, self.steps,
                          self.num_particles, q_cavity, start, data, own, M, k_fit)
            change = jax.tree_util.tree_map(lambda a, b: a - b, params, start)
            # a shard without records changes nothing
            return jax.tree_util.tree_map(lambda c: jnp.where(jnp.any(own), c, 0.0), change)

        return jax.vmap(fit)(jnp.arange(M), jax.random.split(key, M))

    def release(self, q: g.Gaussian, changes: Any, key: Array) -> Any:
        """The mechanism: the guide's parameters at ``q`` moved by the average of the clipped
        changes, plus ``N(0, (noise_multiplier * clip / shards)^2)`` on each coordinate."""
        total = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0),
                                       clip_records(changes, self.clip))
        std = 0.0 if self.noise_multiplier == 0.0 else self.noise_multiplier * self.clip
        total = _noise(key, total, std)
        return jax.tree_util.tree_map(lambda a, t: a + t / self.shards,
                                      self.guide.params_from(q), total)

    def __call__(self, q_cavity, q, data, mask, rng_key):
        k_fit, k_noise = jax.random.split(rng_key)
        params = self.release(q, self.changes(q_cavity, q, data, mask, k_fit), k_noise)
        nan = jnp.full((), jnp.nan, q.nat1.dtype)
        return LocalResult(self.guide.q_from(params), nan, jnp.asarray(True),
                           jnp.asarray(self.steps))


class NoisyMessage(NamedTuple):
    """PVI's message (:class:`~fedppl.algorithms.pvi.ClientMessage`'s fields) whose delta
    carries distributed DP noise and enters a secure sum as it is: ``noise_share`` is the
    fraction of the noise variance the accounting assumes of a total that this message carries
    (``1 / distributed``, public), so that the server can check that a total carries at least
    all of it (:func:`fedppl.algorithms.secure_pvi.noisy_total_check`: the shares add up to 1
    or more)."""

    delta: g.Gaussian
    free_energy: Array
    cavity_repaired: Array
    converged: Array
    iterations: Array
    noise_share: Array


class VirtualPartiesSolver(NamedTuple):
    """Virtual parties (:class:`DPVirtualParties`): one PVI step per party, vmapped over the
    parties; each party's change of factor is clipped in natural parameters and noised. A noisy
    change that would leave ``q`` improper is scaled down by the client (halving, as the server
    would, down to 2^-10, else dropped): post-processing of the released change with the
    public ``q``, which costs no privacy. With ``distributed=t`` each party adds ``1/t`` of its
    noise variance, a party's non-finite change counts as none, and the client takes the whole
    step (its message stays linear in its noise; the server's step search keeps ``q``
    proper)."""

    model: Callable
    guide: PVIGuide
    optimizer: optax.GradientTransformation
    steps: int
    num_particles: int
    clip: float
    noise_multiplier: float
    parties: int
    distributed: int | None = None

    def changes(self, q: g.Gaussian, data: tuple, mask: Array, parties: g.Gaussian, key: Array
                ) -> g.Gaussian:
        """Each party's change of factor ``q_j / cavity_j - t_j = q_j - q`` (natural
        parameters, stacked on axis 0), with ``cavity_j = q / t_j``."""
        label = shard_labels(mask.shape[0], self.parties)
        start = self.guide.params_from(q)

        def fit(j, t_j, k_fit):
            own = mask & (label == j)
            cavity, _ = g.repair(g.quotient(q, t_j))
            params = _fit(self.model, self.guide, self.optimizer, self.steps,
                          self.num_particles, cavity, start, data, own, 1.0, k_fit)
            change = g.quotient(self.guide.q_from(params), q)
            return jax.tree_util.tree_map(lambda c: jnp.where(jnp.any(own), c, 0.0), change)

        keys = jax.random.split(key, self.parties)
        return jax.vmap(fit)(jnp.arange(self.parties), parties, keys)

    def release(self, q: g.Gaussian, changes: g.Gaussian, key: Array) -> g.Gaussian:
        """The mechanism: each party's clipped change plus its share of the noise
        (``N(0, (noise_multiplier * clip)^2 / (parties * distributed))`` per entry)."""
        std = (0.0 if self.noise_multiplier == 0.0
               else self.noise_multiplier * self.clip / math.sqrt(self.parties * self._t))
        if self.distributed is not None:  # a party whose step failed changes nothing
            ok = jax.vmap(g.is_finite)(changes)
            changes = jax.tree_util.tree_map(
                lambda c: jnp.where(ok.reshape(ok.shape + (1,) * (c.ndim - 1)), c, 0.0),
                changes)
        clipped = clip_records(changes, self.clip)
        keys = jax.random.split(key, self.parties)
        return jax.vmap(lambda c, k: _gaussian_noise(k, c, std))(clipped, keys)

    @property
    def keep_precision(self) -> float:
        """What the server's step must leave of q's precision in every direction
        (:func:`fedppl.algorithms.pvi.server_update`'s ``keep``): half with distributed noise
        (no client halves its noisy step), nothing otherwise."""
        return 0.0 if self.distributed is None else 0.5

    @property
    def _t(self) -> int:
        """How many clients' noise a total the server decodes carries at least (1: central)."""
        return self.distributed or 1

    def message(self, msg: Any) -> Any:
        """The client's message as it leaves: PVI's, or a :class:`NoisyMessage` stating its
        noise when the noise is distributed."""
        if self.distributed is None:
            return msg
        return NoisyMessage(msg.delta, msg.free_energy, msg.cavity_repaired, msg.converged,
                            msg.iterations, jnp.asarray(1.0 / self._t, msg.delta.nat1.dtype))

    def __call__(self, q_cavity, q, data, mask, rng_key, parties):
        k_fit, k_noise = jax.random.split(rng_key)
        noisy = self.release(q, self.changes(q, data, mask, parties, k_fit), k_noise)
        total = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), noisy)
        if self.distributed is None:
            sizes = jnp.asarray(STEP_SIZES, q.nat1.dtype)
            moved = jax.vmap(lambda s: g.product(q, g.scale(total, s)))(sizes)
            ok = g.is_pd(moved) & g.is_finite(moved)
            step = jnp.where(jnp.any(ok), sizes[jnp.argmax(ok)], 0.0)
        else:  # linear in the noise: the server's step search keeps q proper
            step = jnp.ones((), q.nat1.dtype)
        nan = jnp.full((), jnp.nan, q.nat1.dtype)
        new_parties = jax.tree_util.tree_map(lambda t, d: t + step * d, parties, noisy)
        return LocalResult(g.product(q, g.scale(total, step)), nan, jnp.asarray(True),
                           jnp.asarray(self.steps), parties=new_parties)
