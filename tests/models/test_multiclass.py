"""One-vs-each multi-class model: exactness for two classes, the bound, CAVI and PVI."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedppl
from fedppl.families import gaussian as g
from fedppl.guides import PVIGuide, cavi
from fedppl.models.multiclass import one_vs_each, ove_log_lik, predict_proba

model3 = partial(one_vs_each, num_classes=3)


@pytest.fixture(scope="module")
def toy():
    rng = np.random.default_rng(0)
    centres = 0.75 * np.array([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
    y = rng.integers(0, 3, 240)
    X = centres[y] + 0.8 * rng.normal(size=(240, 2))
    guide = PVIGuide(model3, family="fullrank")
    result = cavi.CAVI(model3, guide, num_iters=300).run(X, y)
    return X, y, guide, result


def test_two_classes_are_the_softmax_and_more_are_a_lower_bound():
    rng = np.random.default_rng(1)
    F2, y2 = rng.normal(size=(50, 2)) * 3, rng.integers(0, 2, 50)
    exact2 = jnp.take_along_axis(jax.nn.log_softmax(F2), y2[:, None], 1)[:, 0]
    np.testing.assert_allclose(ove_log_lik(F2, y2), exact2, rtol=1e-12)
    F4, y4 = rng.normal(size=(50, 4)) * 3, rng.integers(0, 4, 50)
    exact4 = jnp.take_along_axis(jax.nn.log_softmax(F4), y4[:, None], 1)[:, 0]
    assert np.all(np.asarray(ove_log_lik(F4, y4)) <= np.asarray(exact4) + 1e-12)
    assert np.any(np.asarray(ove_log_lik(F4, y4)) < np.asarray(exact4) - 1e-3)


def test_cavi_is_monotone_accurate_and_below_the_softmax_elbo(toy):
    X, y, guide, result = toy
    trace = np.asarray(result.elbo)
    assert np.all(np.diff(trace) >= -1e-10) and trace[-1] > trace[0]
    probs = predict_proba(jax.random.key(0), guide, result.q, X)
    assert np.mean(np.argmax(probs, 1) == y) > 0.85
    # the CAVI bound is below the ELBO of the exact softmax likelihood (Monte Carlo, 4 se)
    draws = guide.sample(jax.random.key(1), result.q, 4000)
    F = jnp.einsum("nd,sdk->snk", X, draws["W"]) + draws["b"][:, None, :]
    ll = jnp.take_along_axis(jax.nn.log_softmax(F), jnp.broadcast_to(y[None, :, None],
                                                                     (*F.shape[:2], 1)), 2)
    per_draw = np.asarray(ll.sum(axis=(1, 2)))
    softmax_elbo = per_draw.mean() - float(g.kl(result.q, guide.prior))
    se = per_draw.std(ddof=1) / np.sqrt(per_draw.size)
    assert trace[-1] < softmax_elbo + 4 * se


def test_pvi_over_clients_reaches_global_cavi(toy):
    X, y, _, result = toy
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    pvi = fedppl.PVI(model3, PVIGuide(model3, family="fullrank"), conjugate="polya-gamma",
                     elbo_samples=0)
    out = pvi.run(jax.random.key(0), clients, 40, progress_bar=False)
    mean, cov = out.mean_and_cov()
    ref_mean, ref_cov = g.to_moments(result.q)
    # PVI contracts by ~0.75 per round here (the class functions are strongly coupled)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-5)
    np.testing.assert_allclose(cov, ref_cov, atol=1e-5)


def test_bad_labels_are_named(toy):
    X, y = toy[:2]
    with pytest.raises(ValueError, match=r"labels \[3\] are not class indices in 0..2"):
        cavi.CAVI(model3).run(X, np.where(y == 0, 3, y))
