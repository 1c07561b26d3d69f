from __future__ import annotations

import itertools
import math

import dp_accounting
import jax
import numpy as np
import pytest
from dp_accounting import pld

from fedppl import privacy


def rbf(A, B, lengthscale=0.7, variance=1.0):
    A = np.asarray(A, dtype=float).reshape(len(A), -1)
    B = np.asarray(B, dtype=float).reshape(len(B), -1)
    d2 = ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)
    return variance * np.exp(-0.5 * d2 / lengthscale**2)


def random_correlation(n, seed):
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(n, n + 2))
    S = A @ A.T + 0.5 * np.eye(n)
    s = np.sqrt(np.diag(S))
    return S / np.outer(s, s)  # SPD with unit diagonal, like a unit-variance kernel


# ---------------------------------------------------------------------------------------------
# c(delta)


def test_c_delta_hall_rule():
    assert privacy.c_delta(0.01) == pytest.approx(math.sqrt(2 * math.log(200)))
    assert privacy.c_delta(0.01) == pytest.approx(3.2552, abs=1e-4)
    assert privacy.c_delta(0.00625, "hall") == pytest.approx(math.sqrt(2 * math.log(320)))


def test_c_delta_thesis_rule_is_its_literal_formula():
    # thesis Sec. 1.4: c(delta) >= sqrt(2 log(1.25 / delta))
    assert privacy.c_delta(0.01, "thesis") == pytest.approx(math.sqrt(2 * math.log(125)))
    # at the thesis's own settings the formula gives 3.255, not the quoted 0.42
    value = privacy.c_delta(0.00625, "thesis")
    assert value == pytest.approx(3.2552, abs=1e-4)
    assert abs(value - 0.42) > 1 and abs(privacy.c_delta(0.00625) - 0.42) > 1
    assert privacy.c_delta(0.01, "thesis") < privacy.c_delta(0.01, "hall")


@pytest.mark.parametrize("delta", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_c_delta_rejects_delta_outside_unit_interval(delta):
    with pytest.raises(ValueError, match="delta"):
        privacy.c_delta(delta)


def test_c_delta_rejects_unknown_rule():
    with pytest.raises(ValueError, match="rule"):
        privacy.c_delta(0.01, "dwork")


# ---------------------------------------------------------------------------------------------
# sensitivity


def test_sensitivity_is_d_times_max_abs_row_sum_of_inverse():
    K = random_correlation(6, seed=0)
    C = np.linalg.inv(K + 0.3 * np.eye(6))
    expected = 0.8 * np.abs(C).sum(axis=1).max()
    assert privacy.gp_mean_sensitivity(K, 0.3, 0.8) == pytest.approx(expected, rel=1e-10)


def test_sensitivity_is_linear_in_d():
    K = random_correlation(5, seed=1)
    base = privacy.gp_mean_sensitivity(K, 0.1, 1.0)
    for d in (0.5, 2.0, 7.0):
        assert privacy.gp_mean_sensitivity(K, 0.1, d) == pytest.approx(d * base, rel=1e-12)
        assert privacy.gp_mean_sensitivity(K, 0.1, d, method="rkhs") == pytest.approx(
            d * privacy.gp_mean_sensitivity(K, 0.1, 1.0, method="rkhs"), rel=1e-12)


def test_rkhs_sensitivity_is_exact_and_below_smith_bound():
    X = np.linspace(0, 3, 7)
    K = rbf(X, X)
    C = np.linalg.inv(K + 0.1 * np.eye(7))
    exact = max(math.sqrt(C[:, j] @ K @ C[:, j]) for j in range(7))  # ||delta f||_H, d = 1
    rkhs = privacy.gp_mean_sensitivity(K, 0.1, 1.0, method="rkhs")
    assert rkhs == pytest.approx(exact, rel=1e-8)
    assert rkhs <= privacy.gp_mean_sensitivity(K, 0.1, 1.0)


def test_sensitivity_validation():
    K = random_correlation(4, seed=2)
    for d in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="d"):
            privacy.gp_mean_sensitivity(K, 0.1, d)
    with pytest.raises(ValueError, match="positive definite"):
        privacy.gp_mean_sensitivity(-np.eye(3), 0.0, 1.0)
    with pytest.raises(ValueError, match="square"):
        privacy.gp_mean_sensitivity(np.ones((2, 3)), 0.1, 1.0)
    with pytest.raises(ValueError, match="symmetric"):
        privacy.gp_mean_sensitivity(np.array([[1.0, 0.5], [0.0, 1.0]]), 0.1, 1.0)
    with pytest.raises(ValueError, match="noise_var"):
        privacy.gp_mean_sensitivity(K, -0.1, 1.0)
    with pytest.warns(RuntimeWarning, match="k\\(x, x'\\)"):
        privacy.gp_mean_sensitivity(4.0 * K, 0.1, 1.0)


# ---------------------------------------------------------------------------------------------
# empirical DP check (in the style of Smith et al.'s tests)


def _privacy_losses(R, mu, mu_prime, cov):
    """log N(R; mu, cov) - log N(R; mu', cov) for each row of R."""
    P = np.linalg.pinv(cov, hermitian=True)
    a, b = R - mu, R - mu_prime
    return 0.5 * (np.einsum("si,ij,sj->s", b, P, b) - np.einsum("si,ij,sj->s", a, P, a))


@pytest.fixture(scope="module", params=["smith", "rkhs"])
def neighbours(request):
    # well-separated training inputs, so that the sensitivity bound is nearly attained at the
    # released points and cutting the noise has to show up in the privacy loss
    rng = np.random.default_rng(3)
    X = np.arange(8.0)
    Xs = np.array([1.0, 2.0, 3.5, 5.0, 6.0])  # released points
    noise_var, d = 0.1, 1.0
    K = rbf(X, X, lengthscale=0.5)
    W = rbf(Xs, X, lengthscale=0.5) @ np.linalg.inv(K + noise_var * np.eye(8))
    Kss = rbf(Xs, Xs, lengthscale=0.5)
    y = np.sin(X) + 0.3 * rng.normal(size=8)
    # perturb the label whose change moves the released mean furthest (Mahalanobis in K**)
    moves = [W[:, j] @ np.linalg.solve(Kss, W[:, j]) for j in range(8)]
    y_prime = y.copy()
    y_prime[int(np.argmax(moves))] -= d
    sens = privacy.gp_mean_sensitivity(K, noise_var, d, method=request.param)
    assert math.sqrt(max(moves)) <= sens  # the bound covers the actual move
    return W @ y, W @ y_prime, Kss, sens


def _fraction_above(neighbours, eps, delta, shrink, n=20_000, seed=0):
    mu, mu_prime, Kss, sens = neighbours
    batch = np.broadcast_to(mu, (n, len(mu)))
    out = privacy.release_mean(seed, batch, Kss, sens / shrink, eps, delta)
    S = out.noise_scale**2 * Kss
    forward = np.mean(_privacy_losses(out.mean, mu, mu_prime, S) > eps)
    out2 = privacy.release_mean(seed + 1, np.broadcast_to(mu_prime, (n, len(mu))), Kss,
                                sens / shrink, eps, delta)
    backward = np.mean(_privacy_losses(out2.mean, mu_prime, mu, S) > eps)
    return forward, backward


@pytest.mark.parametrize("eps,delta", [(1.0, 0.01), (0.5, 0.05)])
def test_empirical_privacy_loss_exceeds_epsilon_with_probability_at_most_delta(
        neighbours, eps, delta):
    n = 20_000
    slack = 4 * math.sqrt(delta * (1 - delta) / n)
    for frac in _fraction_above(neighbours, eps, delta, shrink=1.0, n=n):
        assert frac <= delta + slack


def test_empirical_check_fails_when_noise_is_cut_tenfold(neighbours):
    eps, delta, n = 1.0, 0.01, 20_000
    slack = 4 * math.sqrt(delta * (1 - delta) / n)
    for frac in _fraction_above(neighbours, eps, delta, shrink=10.0, n=n):
        assert frac > delta + slack


# ---------------------------------------------------------------------------------------------
# release_mean


def test_release_mean_shape_scale_and_reproducibility():
    Xs = np.linspace(0, 2, 4)
    mean = np.array([0.1, -0.2, 0.3, 0.0])
    a = privacy.release_mean(7, mean, rbf(Xs, Xs), 0.5, 1.0, 0.01)
    b = privacy.release_mean(7, mean, rbf(Xs, Xs), 0.5, 1.0, 0.01)
    c = privacy.release_mean(8, mean, rbf(Xs, Xs), 0.5, 1.0, 0.01)
    assert isinstance(a, privacy.DPRelease)
    assert a.mean.shape == mean.shape
    np.testing.assert_array_equal(a.mean, b.mean)
    assert not np.allclose(a.mean, c.mean)
    assert a.noise_scale == pytest.approx(0.5 * privacy.c_delta(0.01) / 1.0)
    assert (a.epsilon, a.delta) == (1.0, 0.01)
    t = privacy.release_mean(7, mean, rbf(Xs, Xs), 0.5, 1.0, 0.01, rule="thesis")
    assert t.noise_scale == pytest.approx(0.5 * privacy.c_delta(0.01, "thesis"))


def test_release_mean_accepts_jax_key_and_generator():
    Xs = np.linspace(0, 2, 3)
    k1 = privacy.release_mean(jax.random.key(0), np.zeros(3), rbf(Xs, Xs), 1.0, 1.0, 0.01)
    k2 = privacy.release_mean(jax.random.key(0), np.zeros(3), rbf(Xs, Xs), 1.0, 1.0, 0.01)
    k3 = privacy.release_mean(jax.random.key(1), np.zeros(3), rbf(Xs, Xs), 1.0, 1.0, 0.01)
    np.testing.assert_array_equal(k1.mean, k2.mean)
    assert not np.allclose(k1.mean, k3.mean)
    legacy = privacy.release_mean(jax.random.PRNGKey(0), np.zeros(3), rbf(Xs, Xs), 1, 1, 0.01)
    assert legacy.mean.shape == (3,)
    g = privacy.release_mean(np.random.default_rng(0), np.zeros(3), rbf(Xs, Xs), 1, 1, 0.01)
    assert g.mean.shape == (3,)


def test_release_mean_noise_has_the_prior_covariance_times_scale():
    Xs = np.array([0.0, 0.5, 2.0, 2.1])  # the last two nearly coincide
    prior = rbf(Xs, Xs, variance=np.array(2.0))
    n = 20_000
    mean = np.broadcast_to(np.arange(4.0), (n, 4))
    out = privacy.release_mean(1, mean, prior, 0.3, 0.8, 0.02)
    noise = out.mean - mean
    expected_std = out.noise_scale * np.sqrt(np.diag(prior))
    np.testing.assert_allclose(noise.std(axis=0), expected_std, rtol=4 / math.sqrt(2 * n))
    np.testing.assert_allclose(noise.mean(axis=0), 0, atol=4 * expected_std.max() / math.sqrt(n))
    corr = np.corrcoef(noise.T)
    np.testing.assert_allclose(corr, prior / 2.0, atol=0.03)


def test_release_mean_singular_prior_gets_jitter():
    X = np.array([0.0, 0.0, 1.0])  # repeated point: singular prior covariance
    out = privacy.release_mean(0, np.zeros(3), rbf(X, X), 1.0, 1.0, 0.01)
    assert np.all(np.isfinite(out.mean))
    assert out.mean[0] == pytest.approx(out.mean[1], abs=1e-4)


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), float("inf")])
def test_release_mean_rejects_bad_epsilon(eps):
    with pytest.raises(ValueError, match="epsilon"):
        privacy.release_mean(0, np.zeros(2), np.eye(2), 1.0, eps, 0.01)


@pytest.mark.parametrize("delta", [0.0, 1.0, 2.0, -0.5])
def test_release_mean_rejects_bad_delta(delta):
    with pytest.raises(ValueError, match=f"delta={float(delta)}"):
        privacy.release_mean(0, np.zeros(2), np.eye(2), 1.0, 1.0, delta)


def test_release_mean_other_validation():
    with pytest.raises(ValueError, match="sensitivity"):
        privacy.release_mean(0, np.zeros(2), np.eye(2), -1.0, 1.0, 0.01)
    with pytest.raises(ValueError, match="points"):
        privacy.release_mean(0, np.zeros(3), np.eye(2), 1.0, 1.0, 0.01)
    with pytest.raises(ValueError, match="semi-definite"):
        privacy.release_mean(0, np.zeros(2), -np.eye(2), 1.0, 1.0, 0.01)


def test_release_mean_warns_above_epsilon_one():
    with pytest.warns(RuntimeWarning, match="epsilon"):
        privacy.release_mean(0, np.zeros(2), np.eye(2), 1.0, 2.0, 0.01)


# ---------------------------------------------------------------------------------------------
# accounting


def test_one_release_matches_dp_accounting_directly():
    sigma = privacy.c_delta(0.01) / 1.0
    acc = privacy.PrivacyAccountant()
    assert acc.epsilon(1e-5) == 0.0 and acc.count == 0
    acc.record(sigma)
    direct = pld.PLDAccountant()
    direct.compose(dp_accounting.GaussianDpEvent(sigma))
    assert acc.epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-2)
    assert acc.epsilon(1e-5) == pytest.approx(
        dp_accounting.get_epsilon_gaussian(sigma, 1e-5), rel=1e-2)
    # the exact one-shot cost at the calibration delta is below the nominal epsilon = 1
    assert acc.epsilon(0.01) < 1.0


def test_fresh_releases_compose_and_grow_monotonically():
    sigma = privacy.c_delta(0.01) / 1.0
    acc = privacy.PrivacyAccountant()
    eps = []
    for _ in range(6):
        acc.record(sigma)
        eps.append(acc.epsilon(1e-5))
    assert acc.count == 6 and acc.num_mechanisms == 6
    assert all(b > a for a, b in itertools.pairwise(eps))
    # k Gaussian mechanisms compose exactly to one with multiplier sigma / sqrt(k)
    assert eps[-1] == pytest.approx(
        dp_accounting.get_epsilon_gaussian(sigma / math.sqrt(6), 1e-5), rel=1e-2)
    rdp_acc = privacy.PrivacyAccountant(method="rdp")
    for _ in range(6):
        rdp_acc.record(sigma)
    assert rdp_acc.epsilon(1e-5) >= eps[-1]  # RDP is an upper bound, looser than PLD


def test_mixed_multipliers_compose():
    acc = privacy.PrivacyAccountant()
    for s in (2.0, 3.0, 2.0):
        acc.record(s)
    sigma_eff = (2 / 2.0**2 + 1 / 3.0**2) ** -0.5
    assert acc.epsilon(1e-5) == pytest.approx(
        dp_accounting.get_epsilon_gaussian(sigma_eff, 1e-5), rel=1e-2)


def test_reused_sample_path_costs_one_release():
    sigma = 3.0
    once = privacy.PrivacyAccountant(reuse_sample_path=True)
    once.record(sigma)
    many = privacy.PrivacyAccountant(reuse_sample_path=True)
    for _ in range(10):
        many.record(sigma)
    assert many.count == 10 and many.num_mechanisms == 1
    assert many.epsilon(1e-5) == pytest.approx(once.epsilon(1e-5), rel=1e-12)
    fresh = privacy.PrivacyAccountant()
    for _ in range(10):
        fresh.record(sigma)
    assert fresh.epsilon(1e-5) > 2 * many.epsilon(1e-5)
    with pytest.raises(ValueError, match="one multiplier"):
        many.record(2.0)


def test_accountant_validation():
    acc = privacy.PrivacyAccountant()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="noise_multiplier"):
            acc.record(bad)
    acc.record(3.0)
    with pytest.raises(ValueError, match="delta"):
        acc.epsilon(0.0)
    with pytest.raises(ValueError, match="method"):
        privacy.PrivacyAccountant(method="moments")


def test_release_mean_records_in_accountant():
    acc = privacy.PrivacyAccountant()
    for seed in range(3):
        privacy.release_mean(seed, np.zeros(2), np.eye(2), 1.0, 0.5, 0.01, accountant=acc)
    assert acc.count == 3
    assert acc.noise_multipliers == pytest.approx([privacy.c_delta(0.01) / 0.5] * 3)


def test_reused_path_is_one_consistent_function():
    path = privacy.PriorSamplePath(rbf, rng_key_or_seed=0)
    X1, X2 = np.array([0.0, 1.0, 2.0]), np.array([1.0, 3.0])
    g1, g2 = path(X1), path(X2)
    assert g2[0] == pytest.approx(g1[1], abs=1e-4)  # same point, same value
    acc = privacy.PrivacyAccountant(reuse_sample_path=True)
    with pytest.raises(ValueError, match="prior_sample"):
        privacy.release_mean(0, np.zeros(3), rbf(X1, X1), 1.0, 1.0, 0.01, accountant=acc)
    r1 = privacy.release_mean(None, np.zeros(3), None, 1.0, 1.0, 0.01, prior_sample=g1,
                              accountant=acc)
    r2 = privacy.release_mean(None, np.zeros(2), None, 1.0, 1.0, 0.01, prior_sample=g2,
                              accountant=acc)
    np.testing.assert_allclose(r1.mean, r1.noise_scale * g1)
    assert r2.mean[0] == pytest.approx(r1.mean[1], abs=1e-3)
    assert acc.count == 2 and acc.num_mechanisms == 1


def test_prior_sample_path_has_prior_covariance():
    X1, X2 = np.array([0.0, 0.8]), np.array([0.4, 1.5])
    draws = []
    for seed in range(3000):
        path = privacy.PriorSamplePath(rbf, seed)
        draws.append(np.concatenate([path(X1), path(X2)]))  # sequential conditioning
    X = np.concatenate([X1, X2])
    np.testing.assert_allclose(np.cov(np.array(draws).T), rbf(X, X), atol=0.1)
