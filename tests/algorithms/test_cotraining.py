from __future__ import annotations

import numpy as np
import pytest

from fedppl.algorithms import cotraining as ct
from fedppl.infer.co_training import PartyData, run
from fedppl.models import gp


@pytest.fixture(scope="module")
def two_parties():
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
    return [PartyData(a1, ya, p1, t1), PartyData(b2, yb, p2, t2)], yt


@pytest.mark.parametrize("uncertainty", ct.UNCERTAINTIES)
@pytest.mark.parametrize("combination", ct.COMBINATIONS)
def test_messages_are_explicit_and_sized_by_the_mode(two_parties, combination, uncertainty):
    parties, yt = two_parties
    out = run(parties, yt, ct.Settings(combination, uncertainty), rounds=3, fit_steps=50)
    kinds = [type(m).__name__ for m in out.messages]
    assert kinds == ["Query", "Response"] * 6
    answers = [m for m in out.messages if isinstance(m, ct.Response)]
    for k, r in enumerate(a for a in answers if a.sender == 1):
        if uncertainty == "none":
            assert r.cov_row is None
        else:
            assert len(r.cov_row) == (k + 1 if uncertainty == "full" else 1)
        assert (r.prior_row is None) == (combination == "noisy")
        assert r.dp_noise_std == 0.0
    assert len(set(out.queried(0))) == 3 and np.all(np.isfinite(out.rmse_after))


def test_limits_of_a_vague_answer(two_parties):
    """Noisy: an answer with a huge variance carries no information (the party's own GP).
    Hybrid (Eq. 4.10): the other view's precision vanishes, and the answer remains an ordinary
    observation under the party's own kernel and noise."""
    parties, _ = two_parties
    a = ct.init_party(0, parties[0].X, parties[0].y, parties[0].pool, 100)
    test = parties[0].test
    vague = ct.Response(1, 4, 3.0, np.array([1e12]), np.array([1.0]), 0.0)
    noisy = ct.Settings("noisy", "marginal")
    base, _ = ct.predict(a, test, noisy)
    np.testing.assert_allclose(ct.predict(ct.receive(a, vague, noisy), test, noisy)[0], base,
                               atol=1e-6)
    sharp = ct.receive(a, vague._replace(cov_row=np.array([1e-4])), noisy)
    assert np.abs(np.asarray(ct.predict(sharp, test, noisy)[0]) - base).max() > 1e-2
    hybrid = ct.Settings("hybrid", "marginal")
    got, _ = ct.predict(ct.receive(a, vague, hybrid), test, hybrid)
    X_aug = np.vstack([a.X, a.pool[4:5]])
    ref, _ = gp.predict(a.params, X_aug, np.append(a.y, 3.0), test)
    np.testing.assert_allclose(got, ref, atol=1e-6)


def test_three_parties(two_parties):
    parties, yt = two_parties
    out = run(parties + [parties[0]], yt, ct.Settings("noisy", "full"), rounds=2, fit_steps=30)
    assert len(out.rmse_after) == 3
    assert sum(isinstance(m, ct.Response) for m in out.messages) == 2 * 3 * 2


def test_bad_input(two_parties):
    parties, yt = two_parties
    short = parties[1]._replace(pool=parties[1].pool[:40])
    with pytest.raises(ValueError, match="party 1's pool has 40 points but party 0's has 60"):
        run([parties[0], short], yt)
    b = ct.init_party(1, parties[1].X, parties[1].y, parties[1].pool, 20)
    settings = ct.Settings()
    _, b = ct.respond(b, ct.Query(0, 7), settings, np.random.default_rng(0))
    with pytest.raises(ValueError, match="asked again for pool index 7"):
        ct.respond(b, ct.Query(0, 7), settings, np.random.default_rng(0))
    with pytest.raises(ValueError, match="pool index 99"):
        ct.respond(b, ct.Query(0, 99), settings, np.random.default_rng(0))
    with pytest.raises(ValueError, match="combination must be one of"):
        run(parties, yt, ct.Settings("average", "full"))


def test_dp_releases_are_noised_and_accounted(two_parties):
    parties, yt = two_parties
    dp = ct.DPSettings(epsilon=1.0, delta=0.01, sensitivity="rkhs")
    out = run(parties, yt, ct.Settings("noisy", "marginal", dp), rounds=3, fit_steps=50)
    answers = [m for m in out.messages if isinstance(m, ct.Response)]
    assert all(r.dp_noise_std > 0 for r in answers)
    # inflate_variance: the reported variance includes the DP noise variance
    assert all(r.cov_row[-1] >= r.dp_noise_std**2 for r in answers)
    one = ct.init_party(0, parties[0].X, parties[0].y, parties[0].pool, 50, dp).accountant
    one.record(out.states[0].accountant.noise_multipliers[0])
    assert out.epsilon[0] > one.epsilon(0.01) > 0  # three releases cost more than one
    assert out.states[0].accountant.count == 3
    with pytest.raises(ValueError, match="epsilon"):
        run(parties, yt, ct.Settings("noisy", "none", dp._replace(epsilon=0.0)), rounds=1,
            fit_steps=10)
    with pytest.raises(ValueError, match="delta"):
        run(parties, yt, ct.Settings("noisy", "none", dp._replace(delta=1.5)), rounds=1,
            fit_steps=10)


def test_hybrid_predictions_do_not_depend_on_the_reported_uncertainty(two_parties):
    """Eq. 4.10 adds the other view's precision only on queried, hence observed, points; the
    conditional of unobserved points given observed ones keeps the blocks Lambda_tt and
    Lambda_to, so V and K_2 drop out of the predictions (they would matter only to a refit)."""
    parties, _ = two_parties
    a = ct.init_party(0, parties[0].X, parties[0].y, parties[0].pool, 100)
    hybrid = ct.Settings("hybrid", "marginal")
    answer = ct.Response(1, 4, 0.7, np.array([1e-3]), np.array([0.9]), 0.0)
    sharp, _ = ct.predict(ct.receive(a, answer, hybrid), parties[0].test, hybrid)
    vague = answer._replace(cov_row=np.array([50.0]), prior_row=np.array([3.0]))
    other, _ = ct.predict(ct.receive(a, vague, hybrid), parties[0].test, hybrid)
    np.testing.assert_allclose(sharp, other, atol=1e-8)
