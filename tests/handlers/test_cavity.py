from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer import Trace_ELBO
from numpyro.infer.util import log_density

from fedppl.families import gaussian as g
from fedppl.guides import PVIGuide
from fedppl.handlers import cavity
from fedppl.sites import SiteLayout


def three_site_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.LogNormal(0.0, 0.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, s), obs=y)


@pytest.fixture
def data():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(20, 2))
    return X, X @ np.array([1.0, -1.0]) + 0.3 + 0.4 * rng.normal(size=20)


def correlated(rng, d):
    a = rng.normal(size=(d, d))
    return g.FullGaussian.from_moments(rng.normal(size=d), a @ a.T + 0.5 * np.eye(d))


@pytest.mark.parametrize("family", ["fullrank", "meanfield"])
def test_joint_log_density_is_likelihood_plus_cavity(data, family):
    X, y = data
    layout = SiteLayout.from_model(three_site_model, X, y)
    rng = np.random.default_rng(0)
    q_cav = correlated(rng, layout.dim)
    if family == "meanfield":
        q_cav = g.project_diag(q_cav)
    theta = jnp.asarray(rng.normal(size=layout.dim))
    values = layout.constrain(theta)
    got, _ = log_density(cavity(three_site_model, q_cav, layout), (X, y), {}, values)
    w, b, s = values["w"], values["b"], values["s"]
    loglik = dist.Normal(X @ w + b, s).log_prob(y).sum()
    # density of s = exp(u) carries the Jacobian -u
    expected = loglik + g.log_prob(q_cav, theta) - theta[layout["s"].slice][0]
    np.testing.assert_allclose(got, expected, rtol=1e-10)


def test_elbo_equals_closed_form_local_free_energy(data):
    X, y = data
    noise = 0.5

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w + b, noise), obs=y)

    guide = PVIGuide(model, family="fullrank").setup(X, y)
    rng = np.random.default_rng(1)
    q_cav = correlated(rng, 3)
    a = rng.normal(size=(3, 3))
    q = g.FullGaussian.from_moments(np.array([1.0, -1.0, 0.3]), 0.002 * (a @ a.T + np.eye(3)))
    params = guide.params_from(q)
    local = cavity(model, q_cav, guide.layout)
    elbo = Trace_ELBO(num_particles=4000)
    estimates = np.array([-elbo.loss(jax.random.key(i), params, local, guide, X, y)
                          for i in range(10)])
    mean, cov = g.to_moments(q)
    A = np.column_stack([X, np.ones(len(y))])  # theta = (w, b)
    err = y - A @ mean
    ell = np.sum(-0.5 * np.log(2 * np.pi * noise**2)
                 - (err**2 + np.einsum("nd,de,ne->n", A, cov, A)) / (2 * noise**2))
    closed = ell - g.kl(q, q_cav)
    se = estimates.std(ddof=1) / np.sqrt(len(estimates))
    assert abs(estimates.mean() - closed) < 4 * se + 1e-8, (estimates.mean(), closed, se)
    # the free energy under another cavity is far away: the test can fail
    wrong = ell - g.kl(q, correlated(rng, 3))
    assert abs(estimates.mean() - wrong) > 10 * se


def test_composes_with_numpyro_handlers(data):
    X, y = data
    layout = SiteLayout.from_model(three_site_model, X, y)
    q_cav = correlated(np.random.default_rng(2), layout.dim)
    model = cavity(three_site_model, q_cav, layout)
    tr = handlers.trace(handlers.seed(model, 0)).get_trace(X, y)
    assert set(tr) == {"w", "b", "s", "y", "data"}
    assert float(tr["s"]["value"]) > 0
    hidden = handlers.trace(handlers.seed(handlers.block(model, hide=["w"]), 0)).get_trace(X, y)
    assert "w" not in hidden
    values = layout.constrain(jnp.zeros(layout.dim))
    base, _ = log_density(model, (X, y), {}, values)
    doubled, _ = log_density(handlers.scale(model, 2.0), (X, y), {}, values)
    np.testing.assert_allclose(doubled, 2 * base, rtol=1e-12)
    masked, _ = log_density(handlers.mask(model, mask=False), (X, y), {}, values)
    assert float(masked) == 0.0
    sub = handlers.trace(handlers.seed(handlers.substitute(model, data=values), 1)).get_trace(X, y)
    np.testing.assert_allclose(sub["w"]["value"], values["w"])


def test_rejects_a_cavity_of_the_wrong_dimension(data):
    X, y = data
    layout = SiteLayout.from_model(three_site_model, X, y)
    with pytest.raises(ValueError, match="dimension 2"):
        cavity(three_site_model, g.DiagGaussian(jnp.zeros(2), jnp.ones(2)), layout)
