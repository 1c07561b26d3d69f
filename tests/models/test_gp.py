from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import multivariate_normal

from fedppl.models import gp


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (40, 1))
    return X, np.sin(X[:, 0]) + 0.1 * rng.normal(size=40)


def test_marginal_likelihood_and_prediction_match_dense_formulas(data):
    X, y = data
    p = gp.init_params(1, lengthscale=0.8, variance=1.5, noise=0.2)
    K = 1.5 * np.exp(-0.5 * (X - X.T) ** 2 / 0.64)
    C = K + 0.04 * np.eye(40)
    ref = -multivariate_normal(np.zeros(40), C).logpdf(y)
    assert float(gp.neg_log_marginal(p, X, y)) == pytest.approx(ref, rel=1e-10)
    Xs = np.array([[0.3], [2.0]])
    Ks = 1.5 * np.exp(-0.5 * (X - Xs.T) ** 2 / 0.64)
    mean, cov = gp.predict(p, X, y, Xs, full_cov=True)
    np.testing.assert_allclose(mean, Ks.T @ np.linalg.solve(C, y), rtol=1e-9)
    Kss = 1.5 * np.exp(-0.5 * (Xs - Xs.T) ** 2 / 0.64)
    np.testing.assert_allclose(cov, Kss - Ks.T @ np.linalg.solve(C, Ks), atol=1e-10)


def test_type_two_ml_improves_the_evidence_and_finds_the_noise(data):
    X, y = data
    start = gp.init_params(1)
    p = gp.fit(X, y, steps=400)
    assert float(gp.neg_log_marginal(p, X, y)) < float(gp.neg_log_marginal(start, X, y))
    assert 0.05 < float(np.exp(p.log_noise)) < 0.2


def test_fit_takes_any_optax_optimiser_and_refuses_a_string(data):
    import optax

    X, y = data
    p = gp.fit(X, y, steps=50, optimizer=optax.sgd(1e-3))
    assert float(gp.neg_log_marginal(p, X, y)) < float(gp.neg_log_marginal(gp.init_params(1), X, y))
    with pytest.raises(TypeError, match="optimizer"):
        gp.fit(X, y, steps=5, optimizer="adam")
