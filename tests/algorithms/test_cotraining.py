from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import fedppl
from fedppl import privacy
from fedppl.algorithms import cotraining as ct
from fedppl.models import gp
from fedppl.runtime import make_round

ADAM = optax.adam(0.05)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)

    def draw(n):
        y = rng.normal(size=n)
        x1 = 0.9 * y + np.sqrt(1 - 0.81) * rng.normal(size=n)
        x2 = 0.9 * y + np.sqrt(1 - 0.81) * rng.normal(size=n)
        return x1[:, None], x2[:, None], y

    a1, _, ya = draw(20)
    _, b2, yb = draw(20)
    p1, p2, _ = draw(60)
    t1, t2, yt = draw(50)
    return {"data": [(a1, ya), (b2, yb)], "pool": [p1, p2], "test": [t1, t2], "y_test": yt}


@pytest.fixture(scope="module")
def parties(problem):
    return [ct.init_party(v, 2, X, y, problem["pool"][v], ADAM, 100)
            for v, (X, y) in enumerate(problem["data"])]


def run(problem, settings, rounds, fit_steps=50, key=0, extra_party=False):
    data, pool, test = problem["data"], problem["pool"], problem["test"]
    if extra_party:
        data, pool, test = data + data[:1], pool + pool[:1], test + test[:1]
    return fedppl.CoTraining(*settings, fit_steps=fit_steps).run(
        jax.random.key(key), fedppl.Clients.from_list(data), rounds, pool=pool, test=test,
        y_test=problem["y_test"], progress_bar=False)


@pytest.mark.parametrize("uncertainty", ct.UNCERTAINTIES)
@pytest.mark.parametrize("combination", ct.COMBINATIONS)
def test_messages_are_explicit_and_sized_by_the_mode(problem, combination, uncertainty):
    out = run(problem, (combination, uncertainty), rounds=3)
    kinds = [type(m).__name__ for m in out.messages]
    assert kinds == ["Query", "Response"] * 6
    answers = [m for m in out.messages if isinstance(m, ct.Response)]
    for k, r in enumerate(a for a in answers if a.sender == 1):
        assert r.querier == 0
        if uncertainty == "none":
            assert r.cov_row is None
        else:
            assert len(r.cov_row) == (k + 1 if uncertainty == "full" else 1)
        assert (r.prior_row is None) == (combination == "noisy")
        assert r.dp_noise_std == 0.0
    assert len(set(out.queried(0))) == 3 and np.all(np.isfinite(out.rmse_after))


def test_fit_goes_through_minimise_with_any_optimiser(problem):
    X, y = problem["data"][0]
    ours = ct.fit_hyperparameters(X, y, ADAM, 60)
    reference = gp.fit(X, y, steps=60, learning_rate=0.05)  # the hand-written Adam loop
    for a, b in zip(ours, reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    sgd = ct.fit_hyperparameters(X, y, optax.sgd(1e-3), 60)
    assert gp.neg_log_marginal(sgd, X, y) < gp.neg_log_marginal(gp.init_params(1), X, y)


def test_limits_of_a_vague_answer(problem, parties):
    """Noisy: an answer with a huge variance carries no information (the party's own GP).
    Hybrid (Eq. 4.10): the other view's precision vanishes, and the answer remains an ordinary
    observation under the party's own kernel and noise."""
    a, (X, y), test = parties[0], problem["data"][0], problem["test"][0]
    vague = ct.Response(1, 0, 4, 3.0, np.array([1e12]), np.array([1.0]), 0.0)
    noisy = ct.Settings("noisy", "marginal")
    base, _ = ct.predict(a, X, y, test, noisy)
    told = ct.receive(a, [vague], noisy)
    np.testing.assert_allclose(ct.predict(told, X, y, test, noisy)[0], base, atol=1e-6)
    sharp = ct.receive(a, [vague._replace(cov_row=np.array([1e-4]))], noisy)
    assert np.abs(np.asarray(ct.predict(sharp, X, y, test, noisy)[0]) - base).max() > 1e-2
    hybrid = ct.Settings("hybrid", "marginal")
    got, _ = ct.predict(ct.receive(a, [vague], hybrid), X, y, test, hybrid)
    ref, _ = gp.predict(a.params, np.vstack([X, a.pool[4:5]]), np.append(y, 3.0), test)
    np.testing.assert_allclose(got, ref, atol=1e-6)


def test_hybrid_predictions_do_not_depend_on_the_reported_uncertainty(problem, parties):
    """Eq. 4.10 adds the other view's precision only on queried, hence observed, points; the
    conditional of unobserved points given observed ones keeps the blocks Lambda_tt and
    Lambda_to, so V and K_2 drop out of the predictions (they would matter only to a refit)."""
    a, (X, y), test = parties[0], problem["data"][0], problem["test"][0]
    hybrid = ct.Settings("hybrid", "marginal")
    answer = ct.Response(1, 0, 4, 0.7, np.array([1e-3]), np.array([0.9]), 0.0)
    sharp, _ = ct.predict(ct.receive(a, [answer], hybrid), X, y, test, hybrid)
    vague = answer._replace(cov_row=np.array([50.0]), prior_row=np.array([3.0]))
    other, _ = ct.predict(ct.receive(a, [vague], hybrid), X, y, test, hybrid)
    np.testing.assert_allclose(sharp, other, atol=1e-8)


def test_a_responder_refuses_bad_queries(problem, parties):
    b, (X, y) = parties[1], problem["data"][1]
    settings = ct.Settings()
    _, b = ct.answer(b, X, y, [ct.Query(0, 7)], settings)
    assert b.gave[0].tolist() == [7] and b.gave[1].tolist() == [-1]
    with pytest.raises(ValueError, match="asked again for pool index 7"):
        ct.answer(b, X, y, [ct.Query(0, 7)], settings)
    with pytest.raises(ValueError, match="pool index 99"):
        ct.answer(b, X, y, [ct.Query(0, 99)], settings)
    with pytest.raises(ValueError, match="one query from each of parties"):
        ct.answer(b, X, y, [], settings)
    with pytest.raises(ValueError, match="one response from each of parties"):
        ct.receive(parties[0], [], settings)
    dp = ct.Settings(dp=ct.DPSettings(1.0, 0.01))
    with pytest.raises(ValueError, match="needs an rng_key"):
        ct.answer(b, X, y, [ct.Query(0, 3)], dp)


def test_the_trio_relays_queries_and_routes_answers(problem):
    """Two exchanges of the loop runtime: the queries go up and are kept; then each party
    answers the others and receives exactly the responses addressed to it."""
    data = problem["data"] + problem["data"][:1]
    pools = problem["pool"] + problem["pool"][:1]
    clients = fedppl.Clients.from_list(data)
    states = [ct.init_party(k, 3, X, y, pools[k], ADAM, 20) for k, (X, y) in enumerate(data)]
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *states)
    round_fn = make_round(ct.make_trio(ct.Settings()), "loop")
    keys = jax.random.split(jax.random.key(0), 3)
    everyone = np.ones(3, bool)
    server, stacked, queries, replies = round_fn(ct.Relay(), stacked, clients.stacked,
                                                 clients.mask, keys, everyone, keys[0])
    assert replies is None and server.queries.sender.tolist() == [0, 1, 2]
    server, stacked, answers, replies = round_fn(server, stacked, clients.stacked, clients.mask,
                                                 keys, everyone, keys[0])
    assert server.queries is None
    assert [r.querier.tolist() for r in answers.responses] == [[1, 0, 0], [2, 2, 1]]
    for a in range(3):
        got = replies.responses
        assert [int(r.sender[a]) for r in got] == [b for b in range(3) if b != a]
        assert {int(r.pool_index[a]) for r in got} == {int(queries.pool_index[a])}
    assert stacked.got_index.shape == (3, 3, 1) and stacked.gave.shape == (3, 3, 1)
    assert stacked.got_index[0, 0, 0] == -1  # a party's own row stays unused


def test_three_parties(problem):
    out = run(problem, ("noisy", "full"), rounds=2, fit_steps=30, extra_party=True)
    assert len(out.rmse_after) == 3
    assert sum(isinstance(m, ct.Response) for m in out.messages) == 2 * 3 * 2
    assert out.history["messages_up"].tolist() == [9, 9]  # 3 queries + 6 responses a round


def test_dp_releases_are_noised_accounted_per_release_and_keyed(problem):
    dp = ct.DPSettings(epsilon=1.0, delta=0.01, sensitivity="rkhs")
    out = run(problem, ("noisy", "marginal", dp), rounds=3)
    answers = [m for m in out.messages if isinstance(m, ct.Response)]
    assert all(r.dp_noise_std > 0 for r in answers)
    # inflate_variance: the reported variance includes the DP noise variance
    assert all(r.cov_row[-1] >= r.dp_noise_std**2 for r in answers)
    eps = out.history["epsilon"]
    assert eps.shape == (3, 2) and np.all(np.diff(eps, axis=0) > 0)  # each release costs
    party = out.parties[0]
    assert party.dp_multipliers.shape == (3,)
    one = privacy.PrivacyAccountant()
    for sigma in party.dp_multipliers:
        one.record(sigma)
    assert out.epsilon[0] == pytest.approx(one.epsilon(0.01))
    again = run(problem, ("noisy", "marginal", dp), rounds=3)
    other = run(problem, ("noisy", "marginal", dp), rounds=3, key=1)

    def means(r):
        return [m.mean for m in r.messages if isinstance(m, ct.Response)]

    assert means(again) == means(out) and means(other) != means(out)
