"""The polya_gamma handler: augmented log density, recorded logits, masks and bad labels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.util import log_density

from fedppl.families import polya_gamma as pg
from fedppl.handlers import client
from fedppl.handlers.polya_gamma import polya_gamma
from tests.conftest import logistic_model


def mixed_model(X, y_cls=None, y_reg=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y_cls", dist.Bernoulli(logits=X @ w), obs=y_cls)
        numpyro.sample("y_reg", dist.Normal(X @ w, 0.5), obs=y_reg)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(12, 3))
    y = rng.integers(0, 2, 12).astype(float)
    values = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.3)}
    return X, y, values


def test_log_density_is_the_augmented_gaussian_form(data):
    X, y, values = data
    omega = np.random.default_rng(1).uniform(0.05, 0.25, 12)
    f = X @ values["w"] + values["b"]
    lp, tr = log_density(polya_gamma(logistic_model, omega=omega), (X, y), {}, values)
    prior = log_density(logistic_model, (X, y), {}, values)[0] - np.sum(
        dist.Bernoulli(logits=f).log_prob(y))
    expected = np.sum(-np.log(2) + (y - 0.5) * f - 0.5 * omega * f**2)
    np.testing.assert_allclose(lp - prior, expected, rtol=1e-12)
    rec = tr["y"]["infer"]["polya_gamma"]
    np.testing.assert_allclose(rec["logits"], f, rtol=1e-12)
    np.testing.assert_allclose(rec["kappa"], y - 0.5)
    np.testing.assert_allclose(rec["omega"], omega)


def test_bound_minus_kl_touches_bernoulli_at_c_equal_abs_f(data):
    """-log 2 + kappa f - E[omega] f^2/2 - KL[PG(1,c)||PG(1,0)] <= log p(y|f), equal at c = |f|."""
    X, y, values = data
    f = X @ values["w"] + values["b"]
    exact = dist.Bernoulli(logits=f).log_prob(y)
    for c, equal in ((jnp.abs(f), True), (jnp.abs(f) + 0.7, False)):
        m = polya_gamma(logistic_model, omega={"y": pg.mean(1.0, c)})
        tr = trace(substitute(seed(m, 0), data=values)).get_trace(X, y)
        bound = tr["y"]["fn"].log_prob(y) - pg.kl_to_prior(1.0, c)
        if equal:
            np.testing.assert_allclose(bound, exact, rtol=1e-12)
        else:
            assert np.all(np.asarray(bound) < np.asarray(exact))


def test_default_omega_is_prior_mean_and_other_sites_untouched(data):
    X, y, values = data
    y_reg = np.random.default_rng(2).normal(size=12)
    tr = trace(substitute(seed(polya_gamma(mixed_model), 0), data=values)).get_trace(X, y, y_reg)
    np.testing.assert_allclose(tr["y_cls"]["infer"]["polya_gamma"]["omega"], 0.25)
    assert isinstance(tr["y_reg"]["fn"], dist.Normal)
    assert "polya_gamma" not in tr["y_reg"]["infer"]


@pytest.mark.parametrize("inner", [True, False])
def test_masked_rows_do_not_count_either_nesting(data, inner):
    X, y, values = data
    mask = jnp.arange(12) < 8
    y_pad = y.copy()
    # padding may hold anything when the mask is visible (polya_gamma outside client)
    y_pad[8:] = 7.0 if inner else 0.0
    if inner:
        m = polya_gamma(client(logistic_model, mask=mask))
    else:
        m = client(polya_gamma(logistic_model), mask=mask)
    lp, _ = log_density(m, (X, y_pad), {}, values)
    ref, _ = log_density(polya_gamma(logistic_model), (X[:8], y[:8]), {}, values)
    np.testing.assert_allclose(lp, ref, rtol=1e-12)


def test_bad_labels_and_inputs_name_the_site(data):
    X, y, values = data
    with pytest.raises(ValueError, match=r"site 'y'.*\[-1\.0\].*outside \{0, 1\}"):
        log_density(polya_gamma(logistic_model), (X, 2 * y - 1), {}, values)
    X_nan = X.copy()
    X_nan[3, 0] = np.nan
    with numpyro.validation_enabled(False), pytest.raises(ValueError,
                                                          match="site 'y' has non-finite logits"):
        log_density(polya_gamma(logistic_model), (X_nan, y), {}, values)
    with pytest.raises(ValueError, match="site 'y_reg' is not an observed Bernoulli"):
        log_density(polya_gamma(mixed_model, sites=["y_reg"]), (X, y, y), {}, values)
    with pytest.raises(ValueError, match="no omega given for site 'y'"):
        log_density(polya_gamma(logistic_model, omega={"z": 1.0}), (X, y), {}, values)


def test_runs_under_jit_and_differentiates(data):
    X, y, values = data

    @jax.jit
    def lp(w, omega):
        return log_density(polya_gamma(logistic_model, omega=omega), (X, y), {},
                           {"w": w, "b": values["b"]})[0]

    w = values["w"]
    omega = jnp.full(12, 0.2)
    f = X @ w + values["b"]
    grad = jax.grad(lp)(w, omega)
    expected = X.T @ ((y - 0.5) - 0.2 * f) - w  # likelihood term plus the N(0, 1) prior
    np.testing.assert_allclose(grad, expected, rtol=1e-10)
