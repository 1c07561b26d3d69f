from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

from fedppl.families import gaussian as g
from fedppl.sites import SiteLayout, classify, prior_correction, prior_factor


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
    assert layout.corrected == ()
    prior = prior_factor(layout, "fullrank")
    mean, cov = g.to_moments(prior)
    np.testing.assert_allclose(mean[:3], [0.0, 1.0, 0.5])
    np.testing.assert_allclose(np.diag(cov)[:3], [4.0, 4.0, 0.09])
    np.testing.assert_allclose(cov[-2:, -2:], [[1.0, 0.5], [0.5, 1.0]])
    assert prior_correction(model, layout, "fullrank", (), {}) is None
    # a mean-field base keeps the correlated prior's diagonal; the correction restores the rest
    corr = prior_correction(model, layout, "meanfield", (), {})
    base = prior_factor(layout, "meanfield")
    theta = jnp.linspace(-1, 1, layout.dim)
    v = theta[-2:]
    exact = dist.MultivariateNormal(jnp.zeros(2), jnp.array([[1.0, 0.5], [0.5, 1.0]])).log_prob(v)
    np.testing.assert_allclose(g.log_prob(g.DiagGaussian(base.nat1[-2:], base.prec[-2:]), v)
                               + corr(theta), exact, rtol=1e-10)


def hierarchical(X=None):
    tau = numpyro.sample("tau", dist.HalfCauchy(2.0))
    mu = numpyro.sample("mu", dist.Laplace(0.0, 1.5))
    numpyro.sample("alpha", dist.Normal(mu, tau).expand([3]).to_event(1))
    numpyro.sample("pi", dist.Dirichlet(jnp.ones(3)))
    numpyro.sample("w", dist.Normal(0.0, 1.0))
    numpyro.factor("penalty", -0.5 * tau**2)


@pytest.mark.parametrize("family", ["meanfield", "fullrank"])
def test_prior_correction_makes_the_base_the_exact_prior(family):
    """p~(theta) exp(correction(theta)) is the prior density of the unconstrained sites, for
    non-Gaussian priors, a prior whose parameters are other sites, and a factor in no plate."""
    layout = SiteLayout.from_model(hierarchical)
    assert set(layout.corrected) == {"tau", "mu", "alpha", "pi"}
    base = prior_factor(layout, family)
    corr = prior_correction(hierarchical, layout, family, (), {})
    for seed in range(3):
        theta = jnp.asarray(np.random.default_rng(seed).normal(size=layout.dim))
        values = layout.constrain(theta)
        tau, mu = values["tau"], values["mu"]
        exact = (dist.HalfCauchy(2.0).log_prob(tau) + dist.Laplace(0.0, 1.5).log_prob(mu)
                 + dist.Normal(mu, tau).log_prob(values["alpha"]).sum()
                 + dist.Dirichlet(jnp.ones(3)).log_prob(values["pi"])
                 + dist.Normal(0.0, 1.0).log_prob(values["w"]) - 0.5 * tau**2
                 + layout.log_abs_det_jacobian(theta))
        np.testing.assert_allclose(g.log_prob(base, theta) + corr(theta), exact, rtol=1e-10)


def test_dependent_prior_is_never_read_from_one_trace():
    """The base of a site whose prior depends on other sites does not come from one trace's
    values of them (it is placed from many prior draws), and the site is corrected."""
    layout = SiteLayout.from_model(hierarchical)
    alpha = layout["alpha"]
    assert alpha.gaussian is None
    loc, var = alpha.base
    # alpha's prior predictive: mu ~ Laplace(0, 1.5), tau ~ HalfCauchy(2): centred at 0, wide
    assert np.all(np.abs(np.asarray(loc)) < 0.5) and np.all(np.asarray(var) > 1.0)


def test_site_selection_errors():
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        SiteLayout.from_model(model, global_sites=["w", "nope"])
    with pytest.raises(ValueError, match="not in global_sites"):
        SiteLayout.from_model(model, global_sites=["w"])
    with pytest.raises(ValueError, match="no latent"):
        SiteLayout.from_model(lambda: numpyro.sample("y", dist.Normal(0, 1), obs=1.0))


def test_classify_splits_global_and_local_sites():
    def grouped(X, y=None, *, n_groups=2):
        mu = numpyro.sample("mu", dist.Normal(0, 1))
        with numpyro.plate("groups", n_groups):
            a = numpyro.sample("a", dist.Normal(mu, 1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(a[0] + X, 1), obs=y)

    X = np.zeros(5)
    _, glob, loc = classify(grouped, (X, X), {}, ["mu"], None)
    assert glob == ["mu"] and loc == ["a"]
    _, glob, loc = classify(grouped, (X, X), {}, None, ["a"])
    assert glob == ["mu"] and loc == ["a"]
    _, glob, loc = classify(grouped, (X, X), {}, None, None)
    assert glob == ["mu", "a"] and loc == []
    with pytest.raises(ValueError, match=r"local_sites names \['b'\]"):
        classify(grouped, (X, X), {}, None, ["b"])
    with pytest.raises(ValueError, match="must split"):
        classify(grouped, (X, X), {}, ["mu"], ["mu", "a"])


def test_classify_refuses_discrete_sites_and_per_datum_locals():
    def discrete(X):
        numpyro.sample("z", dist.Bernoulli(0.5))

    with pytest.raises(ValueError, match=r"'z' is discrete.*[Mm]arginalise"):
        classify(discrete, (np.zeros(3),), {}, None, None)

    def per_datum(X, y=None):
        mu = numpyro.sample("mu", dist.Normal(0, 1))
        with numpyro.plate("data", X.shape[0]):
            z = numpyro.sample("z", dist.Normal(mu, 1))
            numpyro.sample("y", dist.Normal(z, 1), obs=y)

    with pytest.raises(ValueError, match="local site 'z' sits in the plate 'data'"):
        classify(per_datum, (np.zeros(3),), {}, ["mu"], None)
