from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest
from numpyro import handlers

from fedppl.families import gaussian as g
from fedppl.guides import PVIGuide
from tests.handlers.test_cavity import three_site_model


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(10, 2))
    return X, rng.normal(size=10)


@pytest.mark.parametrize("family", ["meanfield", "fullrank"])
def test_params_round_trip(data, family):
    guide = PVIGuide(three_site_model, family=family).setup(*data)
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 4))
    q = g.FullGaussian.from_moments(rng.normal(size=4), a @ a.T + np.eye(4))
    if family == "meanfield":
        q = g.project_diag(q)
    back = guide.q_from(guide.params_from(q))
    np.testing.assert_allclose(back.prec, q.prec, rtol=1e-10)
    np.testing.assert_allclose(back.nat1, q.nat1, rtol=1e-10, atol=1e-12)


def test_guide_log_density_is_q_in_constrained_space(data):
    guide = PVIGuide(three_site_model, family="fullrank").setup(*data)
    rng = np.random.default_rng(2)
    a = rng.normal(size=(4, 4))
    q = g.FullGaussian.from_moments(rng.normal(size=4), a @ a.T + np.eye(4))
    tr = handlers.trace(handlers.seed(handlers.substitute(guide, data=guide.params_from(q)), 0)
                        ).get_trace(*data)
    theta = tr["_pvi_theta"]["value"]
    total = sum(site["fn"].log_prob(site["value"]).sum() for site in tr.values()
                if site["type"] == "sample")
    s_unconstrained = theta[guide.layout["s"].slice][0]
    np.testing.assert_allclose(total, g.log_prob(q, theta) - s_unconstrained, rtol=1e-10)
    assert float(tr["s"]["value"]) == pytest.approx(float(jnp.exp(s_unconstrained)))


def test_posterior_marginals_and_samples(data):
    guide = PVIGuide(three_site_model, family="meanfield").setup(*data)
    post = guide.posterior(guide.prior)
    assert isinstance(post["s"], dist.TransformedDistribution)
    np.testing.assert_allclose(post["s"].base_dist.base_dist.scale, [0.5])
    draws = guide.sample(jax.random.key(0), guide.prior, 20000)
    assert draws["w"].shape == (20000, 2)
    assert np.median(np.log(draws["s"])) == pytest.approx(0.0, abs=0.03)


def test_needs_setup():
    with pytest.raises(RuntimeError, match="setup"):
        PVIGuide(three_site_model).posterior(None)
