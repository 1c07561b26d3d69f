"""Differentially private PVI (:mod:`fedppl.algorithms.dp_pvi`): the mechanisms keep their
privacy loss within the accounted epsilon (and visibly do not with a tenth of the noise), no
noise and no clipping is PVI's own optax step, the budget is reported and enforced, and bad
settings fail before any client runs."""

from __future__ import annotations

import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedppl
from fedppl import accounting
from fedppl.algorithms.dp_mechanisms import (
    DPSGD,
    LocalAveragingSolver,
    VirtualPartiesSolver,
    clip_records,
    shard_labels,
)
from fedppl.models import logistic_regression as model
from tests.test_priors import robust_regression


def _data(n=120, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    p = 1 / (1 + np.exp(-X @ np.linspace(1.0, -0.5, d)))
    return X, (rng.uniform(size=n) < p) * 1.0


@pytest.fixture(scope="module")
def clients():
    return fedppl.partition.homogeneous(*_data(), num_clients=3, seed=0)


def _flat(tree):
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


# -- no noise, no clipping: PVI's own optax step ------------------------------------------------


def test_no_noise_and_no_clipping_is_pvi(clients):
    common = dict(local_steps=20, num_particles=4, optimizer=optax.adam(0.05), damping=0.5,
                  elbo_samples=0)
    plain = fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", solver="optax",
                       line_search=False, **common).run(jax.random.key(3), clients, 2,
                                                        progress_bar=False)
    dp = fedppl.DPOptimisation(clip=math.inf, noise_multiplier=0.0)
    private = fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", privacy=dp,
                         **common).run(jax.random.key(3), clients, 2, progress_bar=False)
    for a, b in zip(plain.mean_and_cov(), private.mean_and_cov(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
    assert np.all(np.isinf(private.history["epsilon"]))  # no noise: no guarantee, said so
    assert np.all(np.isnan(private.history["free_energy"]))  # diagnostics are not sent


# -- empirical privacy of each mechanism ----------------------------------------------------


def _hockey_stick(mu, mu_prime, outputs, std, eps):
    """Monte Carlo ``delta(eps) = E_{o ~ M(D)}[(1 - exp(eps - L(o)))_+]`` with the privacy loss
    ``L(o) = log N(o; mu, s^2) - log N(o; mu', s^2)``, and the estimate's standard error.
    ``M`` is (eps, delta)-DP exactly when this is at most delta for both orders of D and D'.
    (The share of outputs with ``L > eps`` is a stronger notion, probabilistic DP, that an
    accountant's epsilon does not promise: for one Gaussian mechanism with multiplier 1 the RDP
    epsilon at delta = 0.01 leaves 1.2% of the losses above it.)"""
    a = np.sum((outputs - mu) ** 2, axis=1)
    b = np.sum((outputs - mu_prime) ** 2, axis=1)
    loss = (b - a) / (2 * std**2)
    h = np.maximum(0.0, 1.0 - np.exp(np.minimum(eps - loss, 50.0)))
    return float(np.mean(h)), float(np.std(h) / np.sqrt(len(h)))


def _check(mu, mu_prime, sample, std, eps, shrink):
    """Both orders of the neighbours: (estimate, standard error) each."""
    return (_hockey_stick(mu, mu_prime, sample(True, shrink), std / shrink, eps),
            _hockey_stick(mu_prime, mu, sample(False, shrink), std / shrink, eps))




@pytest.fixture(scope="module")
def sgd_neighbours(clients):
    """One DP-SGD step's released sum on a client's records and without its record 0."""
    guide = fedppl.PVIGuide(model)
    guide.setup(*clients.client(0))
    data, mask = tuple(a[0] for a in clients.stacked), clients.mask[0]
    params = guide.params_from(guide.prior)
    e = jax.random.normal(jax.random.key(1), (4, guide.layout.dim))
    clip, sigma = 0.05, 1.0  # every record's gradient is longer than clip: the bound is attained

    def released(sig, m, keys):
        mech = DPSGD(model, guide, 4, clip, sig)
        return jax.vmap(lambda k: _flat(mech.private_sum(params, e, k, data, m)[0]))(keys)

    one = jax.random.split(jax.random.key(0), 1)
    mu, mu_prime = released(0.0, mask, one)[0], released(0.0, mask.at[0].set(False), one)[0]
    np.testing.assert_allclose(np.linalg.norm(mu - mu_prime), clip, rtol=1e-6)

    def sample(first, shrink, n=20_000):
        m = mask if first else mask.at[0].set(False)
        return np.asarray(released(sigma / shrink, m,
                                   jax.random.split(jax.random.key(10 + first), n)))

    return np.asarray(mu), np.asarray(mu_prime), sample, sigma * clip, sigma


@pytest.fixture(scope="module")
def averaging_neighbours(clients):
    """Local averaging's release on a client's records and without one record."""
    guide = fedppl.PVIGuide(model)
    guide.setup(*clients.client(0))
    data, mask = tuple(a[0] for a in clients.stacked), clients.mask[0]
    clip, sigma = 0.02, 1.0
    # the most a record can move the release: it is alone in its shard, whose fit is then
    # clipped to clip with it and nothing without it (take the first shard count that does it)
    solver = LocalAveragingSolver(model, guide, optax.adam(0.05), 10, 4, clip, sigma, 2)
    M = next(m for m in range(8, 40) if np.sum(
        np.asarray(shard_labels(mask.shape[0], m) == shard_labels(mask.shape[0], m)[0])
        & np.asarray(mask)) == 1)
    solver = solver._replace(shards=M)
    q = guide.prior
    key = jax.random.key(2)
    full = solver.changes(q, q, data, mask, key)
    fewer = solver.changes(q, q, data, mask.at[0].set(False), key)
    shard = int(shard_labels(mask.shape[0], M)[0])
    # one record moves its own shard's fit and nothing else
    rows, rows_fewer = np.asarray(jax.vmap(_flat)(full)), np.asarray(jax.vmap(_flat)(fewer))
    for j in range(M):
        assert np.array_equal(rows[j], rows_fewer[j]) == (j != shard)

    def released(sig, changes, keys):
        mech = solver._replace(noise_multiplier=sig)
        return jax.vmap(lambda k: _flat(mech.release(q, changes, k)))(keys)

    one = jax.random.split(jax.random.key(0), 1)
    mu, mu_prime = released(0.0, full, one)[0], released(0.0, fewer, one)[0]
    np.testing.assert_allclose(np.linalg.norm(mu - mu_prime), clip / M, rtol=1e-6)

    def sample(first, shrink, n=20_000):
        return np.asarray(released(sigma / shrink, full if first else fewer,
                                   jax.random.split(jax.random.key(20 + first), n)))

    return np.asarray(mu), np.asarray(mu_prime), sample, sigma * clip / M, sigma


@pytest.fixture(scope="module")
def parties_changes(clients):
    """Virtual parties' clipped changes on a client's records and without a record that is
    alone in its party (the solver, q, both changes, and the clip and multiplier)."""
    guide = fedppl.PVIGuide(model)
    guide.setup(*clients.client(0))
    data, mask = tuple(a[0] for a in clients.stacked), clients.mask[0]
    clip, sigma = 0.5, 1.0
    M = next(m for m in range(8, 40) if np.sum(
        np.asarray(shard_labels(mask.shape[0], m) == shard_labels(mask.shape[0], m)[0])
        & np.asarray(mask)) == 1)
    solver = VirtualPartiesSolver(model, guide, optax.adam(0.05), 10, 4, clip, sigma, M)
    q = guide.prior
    parties = jax.tree_util.tree_map(lambda t: jnp.zeros((M, *t.shape), t.dtype), q)
    key = jax.random.key(2)
    full = solver.changes(q, data, mask, parties, key)
    fewer = solver.changes(q, data, mask.at[0].set(False), parties, key)
    rows, rows_fewer = np.asarray(jax.vmap(_flat)(full)), np.asarray(jax.vmap(_flat)(fewer))
    shard = int(shard_labels(mask.shape[0], M)[0])
    for j in range(M):
        assert np.array_equal(rows[j], rows_fewer[j]) == (j != shard)
    return solver, q, full, fewer, clip, sigma


def _parties_release(solver, q, changes, sig, keys, others=0):
    """The sum of the parties' noised changes (one client's message) for each key, plus
    ``others`` more clients' messages whose changes are zero (their noise only: a total of
    ``others + 1`` clients, whose other data the neighbours share)."""
    mech = solver._replace(noise_multiplier=sig)
    zero = jax.tree_util.tree_map(jnp.zeros_like, changes)

    def one(k):
        total = _flat(jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0),
                                             mech.release(q, changes, k)))
        for j in range(others):
            total = total + _flat(jax.tree_util.tree_map(
                lambda x: jnp.sum(x, axis=0), mech.release(q, zero, jax.random.fold_in(k, j))))
        return total

    return jax.vmap(one)(keys)


@pytest.fixture(scope="module")
def parties_neighbours(parties_changes):
    """Virtual parties' release (the sum of the parties' noised changes) with and without a
    record that is alone in its party."""
    solver, q, full, fewer, clip, sigma = parties_changes
    one = jax.random.split(jax.random.key(0), 1)
    mu = _parties_release(solver, q, full, 0.0, one)[0]
    mu_prime = _parties_release(solver, q, fewer, 0.0, one)[0]
    np.testing.assert_allclose(np.linalg.norm(mu - mu_prime), clip, rtol=1e-6)

    def sample(first, shrink, n=20_000):
        return np.asarray(_parties_release(solver, q, full if first else fewer, sigma / shrink,
                                           jax.random.split(jax.random.key(30 + first), n)))

    return np.asarray(mu), np.asarray(mu_prime), sample, sigma * clip, sigma


T = 4  # the distributed noise's clients per total


@pytest.fixture(scope="module")
def distributed_neighbours(parties_changes):
    """Virtual parties with the noise distributed over ``T`` clients (``distributed=T``): the
    total of the record's client's message and ``T - 1`` other clients' (each adding a
    ``T``-th of the noise variance), with and without the record: the mechanism the
    accountant counts on a secure total."""
    solver, q, full, fewer, clip, sigma = parties_changes
    solver = solver._replace(distributed=T)
    one = jax.random.split(jax.random.key(0), 1)
    mu = _parties_release(solver, q, full, 0.0, one)[0]
    mu_prime = _parties_release(solver, q, fewer, 0.0, one)[0]

    def sample(first, shrink, n=20_000, others=T - 1):
        return np.asarray(_parties_release(solver, q, full if first else fewer, sigma / shrink,
                                           jax.random.split(jax.random.key(40 + first), n),
                                           others))

    return np.asarray(mu), np.asarray(mu_prime), sample, sigma * clip, sigma


@pytest.mark.parametrize("method", ["rdp", "pld"])
@pytest.mark.parametrize("which", ["sgd_neighbours", "averaging_neighbours",
                                   "parties_neighbours", "distributed_neighbours"])
def test_released_quantity_is_epsilon_delta_private(which, method, request):
    mu, mu_prime, sample, std, sigma = request.getfixturevalue(which)
    delta = 0.01
    eps = accounting.epsilon(dp_accounting.GaussianDpEvent(sigma), delta, method)
    for est, se in _check(mu, mu_prime, sample, std, eps, 1.0):
        assert est <= delta + 4 * se
    for est, se in _check(mu, mu_prime, sample, std, eps, 10.0):
        assert est > delta + 4 * se  # a tenth of the noise breaks the accounted epsilon


def test_one_message_of_distributed_noise_carries_only_its_share(distributed_neighbours):
    """With the noise distributed over ``T`` clients, one client's message alone (noise sd
    ``sigma * clip / sqrt(T)``) breaks the totals' epsilon, and meets the epsilon of multiplier
    ``sigma / sqrt(T)`` that ``result.privacy["message_epsilon"]`` reports."""
    mu, mu_prime, sample, std, sigma = distributed_neighbours
    delta = 0.01
    alone = fedppl.DPVirtualParties(clip=1.0, noise_multiplier=sigma, distributed=T)
    weaker = alone.message_multiplier(sigma)
    assert weaker == pytest.approx(sigma / math.sqrt(T))

    def message(first, shrink, n=20_000):
        return sample(first, shrink, n, others=0)

    eps = accounting.epsilon(dp_accounting.GaussianDpEvent(sigma), delta)
    eps_alone = accounting.epsilon(dp_accounting.GaussianDpEvent(weaker), delta)
    scale = std / math.sqrt(T)
    for est, se in _check(mu, mu_prime, message, scale, eps, 1.0):
        assert est > delta + 4 * se
    for est, se in _check(mu, mu_prime, message, scale, eps_alone, 1.0):
        assert est <= delta + 4 * se


def test_clipping_bounds_every_record():
    tree = {"a": jnp.arange(12.0).reshape(4, 3), "b": jnp.ones((4, 2, 2))}
    norms = np.linalg.norm(np.asarray(jax.vmap(_flat)(clip_records(tree, 2.0))), axis=1)
    assert np.all(norms <= 2.0 + 1e-12) and np.isclose(norms.max(), 2.0)
    same = clip_records(tree, math.inf)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(same),
                                                    jax.tree_util.tree_leaves(tree), strict=True))


# -- accounting -----------------------------------------------------------------------------


@pytest.mark.parametrize("privacy", [
    fedppl.DPOptimisation(clip=1.0, epsilon=2.0, delta=1e-5, rounds=3, sampling_rate=0.3),
    fedppl.DPLocalAveraging(clip=0.5, epsilon=2.0, delta=1e-5, rounds=3, shards=4),
    fedppl.DPVirtualParties(clip=2.0, epsilon=2.0, delta=1e-5, rounds=3, parties=4),
], ids=["dp-sgd", "local-averaging", "virtual-parties"])
def test_calibrated_budget_is_met_reported_and_enforced(clients, privacy):
    pvi = fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", privacy=privacy,
                     local_steps=10, num_particles=4)
    result = pvi.run(jax.random.key(0), clients, 3, progress_bar=False)
    eps = result.history["epsilon"]
    assert eps.shape == (3, 3) and np.all(np.diff(eps, axis=0) > 0)  # cumulative, growing
    assert 0.9 * 2.0 <= result.privacy["worst_epsilon"] <= 2.0  # calibrated to the target
    assert set(result.privacy["epsilon"]) == set(clients.names)
    q_mean, q_cov = result.mean_and_cov()
    assert np.all(np.isfinite(q_mean)) and np.all(q_cov > 0)  # mean-field variances
    if isinstance(privacy, fedppl.DPVirtualParties):  # the parties' factors sum to the client's
        state = pvi.init(jax.random.key(0), clients)
        state, _ = pvi.update(state)
        total = jax.tree_util.tree_map(lambda t: t.sum(axis=1), state.clients.parties)
        for a, b in zip(total, state.clients.factor, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="calibrated for 3 rounds"):
        pvi.run(jax.random.key(0), clients, 4, progress_bar=False)
    state = pvi.init(jax.random.key(0), clients)
    for _ in range(3):
        state, _ = pvi.update(state)
    with pytest.raises(ValueError, match="3 are done and 1 more"):
        pvi.update(state)


def test_a_client_counts_only_its_own_rounds(clients):
    dp = fedppl.DPOptimisation(clip=1.0, noise_multiplier=2.0, sampling_rate=0.5)
    pvi = fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", privacy=dp, local_steps=5,
                     num_particles=2, clients_per_round=1)
    result = pvi.run(jax.random.key(0), clients, 4, progress_bar=False)
    taken = np.isfinite(result.history["step"]).sum(axis=0)
    final = result.history["epsilon"][-1]
    for a in range(3):
        for b in range(3):
            if taken[a] < taken[b]:
                assert final[a] < final[b]
    assert result.privacy["worst_epsilon"] == pytest.approx(final.max())


def test_fixed_size_batches_account_per_client_size():
    X, y = _data(n=90)
    clients = fedppl.Clients.from_list([(X[:20], y[:20]), (X[20:], y[20:])])
    dp = fedppl.DPOptimisation(clip=1.0, noise_multiplier=1.5, batch_size=10)
    pvi = fedppl.PVI(model, fedppl.PVIGuide(model), "synchronous", privacy=dp, local_steps=5,
                     num_particles=2)
    eps = pvi.run(jax.random.key(0), clients, 1, progress_bar=False).history["epsilon"][-1]
    assert eps[0] > eps[1]  # 10 of 20 records a step costs more than 10 of 70
    with pytest.raises(ValueError, match="client 0 holds only 20 records"):
        fedppl.PVI(model, fedppl.PVIGuide(model), privacy=fedppl.DPOptimisation(
            clip=1.0, noise_multiplier=1.0, batch_size=30)).run(jax.random.key(0), clients, 1)


def test_a_prior_that_is_not_gaussian_runs_privately():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(90, 4))
    y = X @ np.array([1.0, -0.5, 0.3, 0.0]) + 0.5 * rng.standard_t(5, size=90)
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    dp = fedppl.DPOptimisation(clip=5.0, noise_multiplier=0.5, sampling_rate=0.5)
    result = fedppl.PVI(robust_regression, fedppl.PVIGuide(robust_regression), "synchronous",
                        privacy=dp, local_steps=10, num_particles=2,
                        optimizer=optax.adam(0.05)).run(jax.random.key(0), clients, 1,
                                                        progress_bar=False)
    s = result.sample(jax.random.key(1), 200)
    assert np.all(np.asarray(s["s"]) > 0) and np.all(np.isfinite(np.asarray(s["w"])))
    assert result.prior_factor is not None  # the prior entered through the server's factor


# -- bad settings fail before any client runs -------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(clip=1.0, epsilon=0.0, rounds=2), "epsilon must be positive"),
    (dict(clip=1.0, epsilon=-1.0, rounds=2), "epsilon must be positive"),
    (dict(clip=1.0, epsilon=1.0, delta=0.0, rounds=2), "delta must be in"),
    (dict(clip=1.0, epsilon=1.0, delta=1.0, rounds=2), "delta must be in"),
    (dict(clip=0.0, noise_multiplier=1.0), "clip must be positive"),
    (dict(clip=-1.0, noise_multiplier=1.0), "clip must be positive"),
    (dict(clip=1.0), "exactly one of epsilon"),
    (dict(clip=1.0, epsilon=1.0, noise_multiplier=1.0, rounds=2), "exactly one of epsilon"),
    (dict(clip=1.0, epsilon=1.0), "give rounds"),
    (dict(clip=math.inf, noise_multiplier=1.0), "finite clip"),
    (dict(clip=1.0, noise_multiplier=-1.0), "noise_multiplier must be"),
    (dict(clip=1.0, noise_multiplier=1.0, sampling_rate=0.0), "sampling_rate"),
    (dict(clip=1.0, noise_multiplier=1.0, sampling_rate=0.5, batch_size=4), "not both"),
    (dict(clip=1.0, noise_multiplier=1.0, accounting="moments"), "accounting"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedppl.DPOptimisation(**kwargs)


def test_unreachable_budget_and_unsupported_runs_fail_early(clients):
    # 100 rounds of 200 unsampled steps at epsilon 0.01: no multiplier below 1e4 meets it
    dp = fedppl.DPOptimisation(clip=1.0, epsilon=1e-4, delta=1e-10, rounds=100)
    with pytest.raises(ValueError, match="no noise multiplier"):
        fedppl.PVI(model, fedppl.PVIGuide(model), privacy=dp).init(jax.random.key(0), clients)
    with pytest.raises(ValueError, match="line_search"):
        fedppl.PVI(model, fedppl.PVIGuide(model), privacy=dp, line_search=True)
    with pytest.raises(ValueError, match="shards must be"):
        fedppl.DPLocalAveraging(clip=1.0, noise_multiplier=1.0, shards=0)
    with pytest.raises(ValueError, match="parties must be"):
        fedppl.DPVirtualParties(clip=1.0, noise_multiplier=1.0, parties=-2)
    with pytest.raises(TypeError, match="privacy must be"):
        fedppl.PVI(model, fedppl.PVIGuide(model), privacy={"epsilon": 1.0})
