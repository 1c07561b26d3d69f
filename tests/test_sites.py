from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from fedppl.families import gaussian as g
from fedppl.sites import NonGaussianPriorError, SiteLayout, prior_factor


def model(X=None):
    numpyro.sample("w", dist.Normal(jnp.array([0.0, 1.0]), 2.0).to_event(1))
    numpyro.sample("s", dist.LogNormal(0.5, 0.3))
    numpyro.sample("M", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
    numpyro.sample("v", dist.MultivariateNormal(jnp.zeros(2), jnp.array([[1.0, 0.5], [0.5, 1.0]])))


def test_layout_flattens_and_round_trips():
    layout = SiteLayout.from_model(model)
    assert layout.names == ("w", "s", "M", "v")
    assert layout.dim == 2 + 1 + 6 + 2
    theta = jnp.arange(layout.dim, dtype=float) / 10
    values = layout.constrain(theta)
    assert values["M"].shape == (2, 3) and values["s"].shape == ()
    assert float(values["s"]) == pytest.approx(np.exp(0.2))
    np.testing.assert_allclose(layout.unconstrain(values), theta, rtol=1e-12)
    assert float(layout.log_abs_det_jacobian(theta)) == pytest.approx(0.2)


def test_prior_factor_reads_gaussian_priors_in_unconstrained_space():
    layout = SiteLayout.from_model(model)
    prior = prior_factor(layout, "fullrank")
    mean, cov = g.to_moments(prior)
    np.testing.assert_allclose(mean[:3], [0.0, 1.0, 0.5])
    np.testing.assert_allclose(np.diag(cov)[:3], [4.0, 4.0, 0.09])
    np.testing.assert_allclose(cov[-2:, -2:], [[1.0, 0.5], [0.5, 1.0]])
    with pytest.raises(ValueError, match="fullrank"):
        prior_factor(layout, "meanfield")


def test_non_gaussian_prior_is_a_clear_error():
    def gamma_model():
        numpyro.sample("tau", dist.Gamma(2.0, 1.0))

    with pytest.raises(NonGaussianPriorError, match="'tau' is Gamma.*LogNormal"):
        prior_factor(SiteLayout.from_model(gamma_model), "meanfield")


def test_site_selection_errors():
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        SiteLayout.from_model(model, global_sites=["w", "nope"])
    with pytest.raises(ValueError, match="not in global_sites"):
        SiteLayout.from_model(model, global_sites=["w"])
    with pytest.raises(ValueError, match="no latent"):
        SiteLayout.from_model(lambda: numpyro.sample("y", dist.Normal(0, 1), obs=1.0))
