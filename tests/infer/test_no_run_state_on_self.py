"""A method holds its settings, never a run (issue 37): ``init``, ``update`` (and FSGP's
``aggregate``) leave the method object as it was, attribute for attribute, and two runs of one
object interleave to the answers two objects give.

Problem sizes and settings are those of the methods' own tests (tests/infer/test_*.py), so that
the compiled rounds are shared where the tests run in one process."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import fedppl
from fedppl.algorithms import cotraining as ct
from fedppl.algorithms.dp_statistics import PrivateStatistics
from fedppl.models.random_features import URKSpec
from tests.conftest import linear_model

TINY = URKSpec(1, feature_widths=(), shift_widths=(), num_samples=5)
# a target epsilon: each run calibrates its noise to the rounds it plans
PRIVATE = PrivateStatistics(epsilon=5000.0, delta=1e-5, feature_bound=1.0, target_bound=3.0)
# FSGP's tests' settings, with the aggregation round's statistics noised
FSGP_CONFIG = fedppl.FSGPConfig(num_inducing=8, optimizer=optax.adam(0.05), local_steps=20,
                                privacy=PrivateStatistics(noise_multiplier=0.5,
                                                          feature_bound=1.0, target_bound=3.0))
COTRAINING_DP = ct.DPSettings(1.0, 0.01, sensitivity="rkhs")


def attributes(method) -> dict[str, int]:
    """The method's attributes, each by identity."""
    return {k: id(v) for k, v in vars(method).items()}


def leaves_equal(a, b) -> None:
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def result_of(state, rows):
    """The result ``run`` would give for ``state`` after the rows ``rows``."""
    history = {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
    return state.plan.result(state, history, list(state.log.rejected))


# -- problems (as in the methods' own tests) ---------------------------------------------------


@pytest.fixture(scope="module")
def two_ranges():
    """FedBNR's: one function, two clients on disjoint halves of [-5, 5], validation data."""
    rng = np.random.default_rng(0)
    x = np.sort(rng.uniform(-5, 5, 200))[:, None]
    y = np.sin(x[:, 0]) + 0.3 * x[:, 0] + 0.3 * rng.normal(size=200)
    clients = fedppl.Clients.from_list([(x[:100], y[:100]), (x[100:150], y[100:150])])
    xv = rng.uniform(-5, 5, (60, 1))
    return clients, (xv, np.sin(xv[:, 0]) + 0.3 * xv[:, 0])


def _sine_clients(seed: int):
    """FSGP's: 3 sin(2 pi x / 20) on [-10, 10], three unbalanced clients, standardised."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-10, 10, size=150)[:, None]
    y = 3 * np.sin(2 * np.pi * x[:, 0] / 20) + 0.5 * rng.normal(size=150)
    idx = [np.arange(0, 30), np.arange(30, 100), np.arange(100, 150)]
    return fedppl.partition.from_indices((x - x.mean()) / x.std(), (y - y.mean()) / y.std(),
                                         idx)


@pytest.fixture(scope="module")
def parties():
    """CoTraining's: two noisy views of one signal, a pool and test inputs."""
    rng = np.random.default_rng(3)

    def draw(n):
        y = rng.normal(size=n)
        return [(0.9 * y + 0.4 * rng.normal(size=n))[:, None] for _ in range(2)], y

    (x1, _), y1 = draw(14)
    (_, x2), y2 = draw(14)
    pool, _ = draw(12)
    test, y_test = draw(25)
    clients = fedppl.Clients.from_list([(x1, y1), (x2, y2)], names=["north", "south"])
    return clients, {"pool": pool, "test": test, "y_test": y_test}


@pytest.fixture(scope="module")
def conjugate():
    """Importance's (and PVI's): ten features, five clients, a linear-Gaussian model."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 10))
    y = X @ rng.normal(size=10) + 0.5 * rng.normal(size=300)
    return fedppl.partition.homogeneous(X, y, num_clients=5, seed=0)


def _pvi():
    return fedppl.PVI(linear_model, fedppl.PVIGuide(linear_model, family="fullrank"))


@pytest.fixture(scope="module")
def answer(conjugate):
    return _pvi().run(jax.random.key(0), conjugate, 2, progress_bar=False)


def _importance(answer):
    return fedppl.Importance(linear_model, answer.guide, answer.q, num_draws=1000)


# -- the checks ---------------------------------------------------------------------------------


def _alone(method, state, rounds: int):
    """``rounds`` updates of a started run; the state and the rows."""
    rows = []
    for _ in range(rounds):
        state, row = method.update(state)
        rows.append(row)
    return state, rows


def _same_rows(got, want, keys) -> None:
    for key in keys:
        np.testing.assert_array_equal(np.asarray([r[key] for r in got]),
                                      np.asarray([r[key] for r in want]), err_msg=key)


def test_pvi_the_reference(conjugate):
    pvi = _pvi()
    before = attributes(pvi)
    state = pvi.init(jax.random.key(0), conjugate)
    assert attributes(pvi) == before
    _alone(pvi, state, 2)
    assert attributes(pvi) == before


def test_fedbnr(two_ranges):
    """Private runs planned for 3 and for 4 rounds (eval_every 2: two evaluations each, so one
    noise multiplier and one trio), interleaved, each counting its own evaluations; a third run
    planned for 20 rounds, started between their rounds, calibrates its own noise."""
    clients, val = two_ranges

    def fresh():
        return fedppl.FedBNR(TINY, local_steps=3, eval_every=2, privacy=PRIVATE)

    def start(method, key, rounds):
        return method.init(jax.random.key(key), clients, validation=val, num_rounds=rounds)

    one = fresh()
    before = attributes(one)
    a, b = start(one, 0, 3), start(one, 1, 4)
    a, row_a = one.update(a)
    b, row_b = one.update(b)
    other = start(one, 2, 20)
    assert other.plan.static.private.sigma > a.plan.static.private.sigma
    assert other.plan.trio is not a.plan.trio and a.plan.trio is b.plan.trio
    a, rows_a = _alone(one, a, 1)
    b, rows_b = _alone(one, b, 1)
    assert attributes(one) == before
    for state, rows, (key, planned) in [(a, [row_a, *rows_a], (0, 3)),
                                        (b, [row_b, *rows_b], (1, 4))]:
        method = fresh()
        want, want_rows = _alone(method, start(method, key, planned), 2)
        _same_rows(rows, want_rows, ("elbo", "val_rmse", "epsilon", "bytes_up", "bytes_down"))
        assert rows[-1]["evaluated"] and rows[-1]["epsilon"] > rows[0]["epsilon"]
        leaves_equal(state.server, want.server)
        got, ref = result_of(state, rows), result_of(want, want_rows)
        assert got.privacy["noise_multiplier"] == ref.privacy["noise_multiplier"]
        np.testing.assert_array_equal(got.privacy["releases"], ref.privacy["releases"])


def test_fsgp_with_its_aggregation_round():
    """Private runs on other clients, interleaved through their FedAvg rounds and their
    aggregation rounds (noised with each run's own keys)."""
    method = fedppl.FSGP(FSGP_CONFIG)
    before = attributes(method)
    a = method.init(jax.random.key(1), _sine_clients(0))
    b = method.init(jax.random.key(2), _sine_clients(1))
    rows_a, rows_b = [], []
    for _ in range(2):
        a, row = method.update(a)
        rows_a.append(row)
        b, row = method.update(b)
        rows_b.append(row)
    a, agg_a = method.aggregate(a)
    b, agg_b = method.aggregate(b)
    assert attributes(method) == before
    M = FSGP_CONFIG.num_inducing
    for state, rows, agg, (key, seed) in [(a, rows_a, agg_a, (1, 0)), (b, rows_b, agg_b, (2, 1))]:
        alone = fedppl.FSGP(FSGP_CONFIG)
        want, want_rows = _alone(alone, alone.init(jax.random.key(key), _sine_clients(seed)), 2)
        want, want_agg = alone.aggregate(want)
        _same_rows(rows, want_rows, ("bound", "bytes_up"))
        assert "bound" not in agg  # the aggregation round's row counts the statistics' bytes
        assert agg["bytes_up"] == want_agg["bytes_up"] == 3 * (M * (M + 1) // 2 + M + 1) * 8
        leaves_equal((state.server.params, state.server.stats),
                     (want.server.params, want.server.stats))


def test_co_training(parties):
    """Runs with other keys (other DP noise), interleaved: each keeps its own messages."""
    clients, data = parties

    def fresh():
        return fedppl.CoTraining("noisy", "full", COTRAINING_DP, fit_steps=30)

    one = fresh()
    before = attributes(one)
    a = one.init(jax.random.key(0), clients, **data)
    b = one.init(jax.random.key(1), clients, **data)
    rows_a, rows_b = [], []
    for _ in range(2):
        a, row = one.update(a)
        rows_a.append(row)
        b, row = one.update(b)
        rows_b.append(row)
    assert attributes(one) == before
    for state, rows, key in [(a, rows_a, 0), (b, rows_b, 1)]:
        method = fresh()
        want, want_rows = _alone(method, method.init(jax.random.key(key), clients, **data), 2)
        _same_rows(rows, want_rows, ("rmse", "epsilon"))
        got, ref = result_of(state, rows), result_of(want, want_rows)
        assert len(got.messages) == 2 * 4  # each round: two queries, one answer to each
        assert [(type(m), m.pool_index) for m in got.messages] == [
            (type(m), m.pool_index) for m in ref.messages]
        np.testing.assert_array_equal([getattr(m, "mean", 0.0) for m in got.messages],
                                      [getattr(m, "mean", 0.0) for m in ref.messages])


def test_importance(conjugate, answer):
    """Runs with other keys, interleaved; the compiled exchange is in the state's plan."""
    one = _importance(answer)
    before = attributes(one)
    a = one.init(jax.random.key(1), conjugate)
    b = one.init(jax.random.key(2), conjugate)
    for _ in range(2):
        a, _ = one.update(a)
        b, _ = one.update(b)
    assert attributes(one) == before
    for state, key in [(a, 1), (b, 2)]:
        method = _importance(answer)
        want, _ = _alone(method, method.init(jax.random.key(key), conjugate), 2)
        np.testing.assert_array_equal(state.log.method.draws, want.log.method.draws)
        np.testing.assert_array_equal(state.log.method.log_lik, want.log.method.log_lik)
    with pytest.raises(RuntimeError, match=r"call Importance.init.* before update"):
        one.update(a._replace(plan=None))
