from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm

from fedppl import metrics

LEVELS = np.linspace(0.01, 0.99, 99)


@pytest.fixture
def regression():
    rng = np.random.default_rng(0)
    n = 20_000
    mean = rng.normal(size=n) * 2.0
    var = rng.uniform(0.2, 3.0, size=n)
    y = mean + np.sqrt(var) * rng.normal(size=n)
    return y, mean, var


# ---------------------------------------------------------------------------------------------
# regression


def test_rmse_and_log_likelihood_match_closed_forms():
    y = np.array([1.0, 2.0, -1.0, 0.5])
    mean = np.array([0.5, 2.5, -1.0, 1.5])
    var = np.array([0.5, 1.0, 2.0, 0.25])
    assert metrics.rmse(y, mean) == pytest.approx(np.sqrt((0.25 + 0.25 + 0.0 + 1.0) / 4))
    expected = np.mean(norm.logpdf(y, mean, np.sqrt(var)))
    assert metrics.gaussian_log_likelihood(y, mean, var) == pytest.approx(expected, rel=1e-12)
    # a scalar variance is broadcast, jax arrays and (N, 1) columns are accepted
    ll = metrics.gaussian_log_likelihood(jnp.asarray(y)[:, None], jnp.asarray(mean), 0.5)
    assert ll == pytest.approx(np.mean(norm.logpdf(y, mean, np.sqrt(0.5))), rel=1e-12)
    assert isinstance(metrics.rmse(jnp.asarray(y), mean), float)


def test_unstandardise_jacobian_identity(regression):
    y, mean, var = regression
    m, s = 3.7, 12.5
    mean_o, var_o = metrics.unstandardise(mean, var, m, s)
    np.testing.assert_allclose(mean_o, mean * s + m)
    np.testing.assert_allclose(var_o, var * s**2)
    y_o = y * s + m
    ll_s = metrics.gaussian_log_likelihood(y, mean, var)
    ll_o = metrics.gaussian_log_likelihood(y_o, mean_o, var_o)
    assert ll_o == pytest.approx(ll_s - np.log(s), rel=1e-10)
    assert metrics.rmse(y_o, mean_o) == pytest.approx(s * metrics.rmse(y, mean), rel=1e-10)
    # calibration is invariant to an affine change of units
    assert metrics.regression_calibration(y_o, mean_o, var_o).ece == pytest.approx(
        metrics.regression_calibration(y, mean, var).ece)


def test_regression_calibration_hand_example():
    d = np.array([0.0, 0.5, 1.0, 2.0])  # distance from the mean in predictive sds
    mean, var = np.array([1.0, -2.0, 0.0, 5.0]), np.array([4.0, 1.0, 0.25, 9.0])
    y = mean + d * np.sqrt(var)
    cal = metrics.regression_calibration(y, mean, var, levels=[0.2, 0.5, 0.9])
    # z = 0.253, 0.674, 1.645: coverages 1/4, 2/4, 3/4
    np.testing.assert_allclose(cal.observed, [0.25, 0.5, 0.75])
    assert cal.ece == pytest.approx((0.05 + 0.0 + 0.15) / 3)
    assert cal.mce == pytest.approx(0.15)
    inside = np.array([[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0]])
    brier = np.mean((inside - np.array([0.2, 0.5, 0.9])) ** 2)
    assert cal.brier == pytest.approx(brier) and brier == pytest.approx(2.6 / 12)


def test_calibrated_predictive_has_small_ece(regression):
    y, mean, var = regression
    cal = metrics.regression_calibration(y, mean, var)
    np.testing.assert_allclose(cal.levels, LEVELS)
    assert cal.ece < 0.02
    assert cal.mce < 0.03
    assert cal.brier == pytest.approx(np.mean(LEVELS * (1 - LEVELS)), abs=0.01)
    assert np.mean(LEVELS * (1 - LEVELS)) == pytest.approx(1 / 6, abs=0.002)


def test_over_and_under_confidence_are_detected(regression):
    y, mean, var = regression
    z = norm.ppf(0.5 + LEVELS / 2)
    over = metrics.regression_calibration(y, mean, var / 25)
    np.testing.assert_allclose(over.observed, 2 * norm.cdf(z / 5) - 1, atol=0.015)
    assert over.ece > 0.3 and over.mce > over.ece
    assert np.all(over.observed < LEVELS)
    under = metrics.regression_calibration(y, mean, var * 25)
    np.testing.assert_allclose(under.observed, 2 * norm.cdf(z * 5) - 1, atol=0.015)
    assert under.ece > 0.2 and under.mce > under.ece
    assert np.all(under.observed >= LEVELS)
    calibrated = metrics.regression_calibration(y, mean, var)
    assert over.brier > calibrated.brier + 0.1 and under.brier > calibrated.brier + 0.05


def test_worst_case_ece_is_about_one_half():
    mean, var = np.zeros(50), np.ones(50)
    cal = metrics.regression_calibration(np.full(50, 100.0), mean, var)
    assert np.all(cal.observed == 0)
    assert cal.ece == pytest.approx(0.5) and cal.mce == pytest.approx(0.99)
    assert cal.brier == pytest.approx(np.mean(LEVELS**2))


# ---------------------------------------------------------------------------------------------
# classification


def test_accuracy_binary_and_multiclass():
    y = np.array([1, 0, 0, 1, 1])
    prob = np.array([0.9, 0.2, 0.6, 0.5, 0.4])  # predictions 1, 0, 1, 1, 0
    assert metrics.accuracy(y, prob) == pytest.approx(3 / 5)
    assert (metrics.accuracy(jnp.asarray(y, dtype=jnp.float32), jnp.asarray(prob))
            == pytest.approx(0.6))
    P = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.2, 0.5, 0.3], [0.4, 0.4, 0.2]])
    assert metrics.accuracy([0, 2, 0, 1], P) == pytest.approx(2 / 4)  # last row argmax -> 0
    # a two-column matrix agrees with the binary form
    assert metrics.accuracy(y, np.stack([1 - prob, prob], 1)) == pytest.approx(0.6)


def test_classification_ece_hand_example():
    y = np.array([1, 0, 0, 1])
    prob = np.array([0.9, 0.8, 0.3, 0.6])  # confidences 0.9, 0.8, 0.7, 0.6; correct 1, 0, 1, 1
    assert metrics.classification_ece(y, prob, num_bins=10) == pytest.approx(
        (0.1 + 0.8 + 0.3 + 0.4) / 4)
    # with 2 bins all four share [0.5, 1]: mean confidence 0.75 = accuracy 0.75
    assert metrics.classification_ece(y, prob, num_bins=2) == pytest.approx(0.0)


def test_classification_ece_calibrated_and_confidently_wrong():
    rng = np.random.default_rng(1)
    prob = rng.uniform(size=20_000)
    y = (rng.uniform(size=prob.size) < prob).astype(int)
    assert metrics.classification_ece(y, prob) < 0.02
    wrong = metrics.classification_ece(1 - (prob > 0.5), np.where(prob > 0.5, 0.999, 0.001))
    assert wrong == pytest.approx(0.999)
    # multi-class: labels drawn from the predicted distribution
    logits = rng.normal(size=(20_000, 4)) * 2
    P = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = (rng.uniform(size=(P.shape[0], 1)) > np.cumsum(P, 1)).sum(1)
    assert metrics.classification_ece(labels, P) < 0.02
    assert metrics.classification_ece(np.argmin(P, 1), P) > 0.5


def test_reliability_diagram_bins_and_drawing():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(2)
    prob = rng.uniform(size=1000)
    y = (rng.uniform(size=1000) < prob).astype(int)
    rel = metrics.reliability_diagram(y, prob, num_bins=10)
    assert rel.count.sum() == 1000
    conf = np.maximum(prob, 1 - prob)
    np.testing.assert_array_equal(rel.count[:5], 0)  # binary confidences are at least 0.5
    assert np.all(np.isnan(rel.accuracy[:5])) and np.all(np.isnan(rel.confidence[:5]))
    np.testing.assert_allclose(rel.confidence[9], conf[conf >= 0.9].mean())
    np.testing.assert_allclose(rel.edges, np.linspace(0, 1, 11))
    fig, ax = plt.subplots()
    drawn = metrics.reliability_diagram(y, prob, num_bins=10, ax=ax)
    assert len(ax.patches) == 5 and len(ax.lines) == 1
    np.testing.assert_array_equal(drawn.count, rel.count)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("call, message", [
    (lambda: metrics.rmse(np.zeros(3), np.zeros(4)), "y has 3 entries but mean has 4"),
    (lambda: metrics.gaussian_log_likelihood(np.zeros(3), np.zeros(3), np.ones(2)),
     "y has 3 entries but var has 2"),
    (lambda: metrics.gaussian_log_likelihood(np.zeros(3), np.zeros(3), [1.0, 0.0, 1.0]),
     "var must be positive"),
    (lambda: metrics.regression_calibration(np.zeros(3), np.zeros(3), -1.0),
     "var must be positive"),
    (lambda: metrics.unstandardise(np.zeros(3), -np.ones(3), 0.0, 1.0), "var must be positive"),
    (lambda: metrics.unstandardise(np.zeros(3), np.ones(3), 0.0, 0.0), "y_std must be positive"),
    (lambda: metrics.rmse([1.0, np.nan], [0.0, 0.0]), "y contains NaN or inf"),
    (lambda: metrics.gaussian_log_likelihood([1.0, 2.0], [0.0, np.inf], 1.0),
     "mean contains NaN or inf"),
    (lambda: metrics.regression_calibration([1.0], [0.0], [1.0], levels=[0.5, 1.0]),
     "strictly between 0 and 1"),
    (lambda: metrics.accuracy([0, 1], [0.5, 1.2]), r"prob must lie in \[0, 1\]"),
    (lambda: metrics.accuracy([0, 1, 1], [0.5, 0.2]), "y has 3 entries but prob has 2"),
    (lambda: metrics.classification_ece([0, 2], [0.5, 0.2]), "binary labels y must be 0 or 1"),
    (lambda: metrics.accuracy([0, 3], np.full((2, 3), 1 / 3)), r"integers in \[0, 2\]"),
    (lambda: metrics.accuracy([0, 1], np.full((2, 3), 0.5)), "sum to 1"),
    (lambda: metrics.accuracy([0, 1], [np.nan, 0.5]), "prob contains NaN or inf"),
    (lambda: metrics.reliability_diagram([0, 1], [0.5, 0.5], num_bins=0), "num_bins"),
])
def test_validation_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_rounds_to_convergence_is_one_based_and_tolerance_driven():
    assert metrics.rounds_to_convergence([0.0, 5.0, 9.0, 9.99, 10.0], 0.1) == 4
    assert metrics.rounds_to_convergence([3.0], 0.0) == 1
    assert metrics.rounds_to_convergence([0.0, 1.0, 0.0, 1.0], 0.5) == 4
    with pytest.raises(ValueError, match="empty"):
        metrics.rounds_to_convergence([], 1.0)
