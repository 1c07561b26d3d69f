"""The one-shot baselines (fedppl.OneShot): Laplace exact where the subposteriors are Gaussian
(with local sites too), the sampled merges within Monte Carlo error, initialising EP and PVI,
bad input."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fedppl
from fedppl.models import linear_regression


def _guide(model=linear_regression, **kw):
    return fedppl.PVIGuide(model, family="fullrank", **kw)


def test_laplace_is_exact_for_gaussian_subposteriors(linear):
    clients, mean, cov = linear
    res = fedppl.OneShot(linear_regression, _guide()).run(jax.random.key(0), clients)
    m, c = res.mean_and_cov()
    np.testing.assert_allclose(m, mean, atol=1e-8)
    np.testing.assert_allclose(c, cov, atol=1e-8)
    assert isinstance(res, fedppl.OneShotResult) and res.method == "laplace"
    # the sites start PVI at its fixed point: one more round moves nothing
    pvi = fedppl.PVI(linear_regression, _guide()).run(jax.random.key(1), clients, 1,
                                                      factors=res.factors, progress_bar=False)
    np.testing.assert_allclose(pvi.mean_and_cov()[0], mean, atol=1e-8)


def test_laplace_with_local_sites_is_exact():
    """Random intercepts (conjugate): the joint mode and Hessian give the exact marginal of the
    global sites (Schur complement) and each client's exact q(a_k | theta)."""
    from tests.reference import unconstrained_moments
    from tests.test_local_sites import exact_posterior, grouped_data, random_intercepts

    parts = grouped_data()
    res = fedppl.OneShot(random_intercepts, _guide(random_intercepts, global_sites=["mu", "w"])
                         ).run(jax.random.key(0), fedppl.Clients.from_list(parts), n_groups=1)
    mean, cov = exact_posterior(parts)
    np.testing.assert_allclose(res.mean_and_cov()[0], mean[:3], atol=1e-7)
    np.testing.assert_allclose(res.mean_and_cov()[1], cov[:3, :3], atol=1e-7)
    a_mean, a_sd = unconstrained_moments(res, client=2)["a"]
    np.testing.assert_allclose(a_mean[0], mean[5], atol=1e-7)
    np.testing.assert_allclose(a_sd[0], np.sqrt(cov[5, 5]), atol=1e-7)


def test_sampled_merges_within_monte_carlo_error(linear):
    """Consensus: its q (the merged draws' Gaussian) and, from the same run, the parametric
    product of its sites (the Gaussians of the subposterior draws) near the exact posterior."""
    from fedppl.families import gaussian as g

    clients, mean, cov = linear
    res = fedppl.OneShot(linear_regression, _guide(), "consensus", num_warmup=200,
                         num_samples=500, num_chains=2).run(jax.random.key(2), clients)
    sd = np.sqrt(np.diag(cov))
    # each subposterior's mean errs by sd_k / sqrt(ESS_k); the product weights them by
    # precision, so q's mean errs by at most sd * sqrt(sum_k 1 / ESS_k) (conservative)
    se = sd * np.sqrt(np.sum(1.0 / res.history["ess"][-1]))
    sites = jax.tree_util.tree_map(lambda x: x.sum(0), res.factors)
    parametric = g.product(res.guide.prior, sites)
    for q in (res.q, parametric):
        m, c = (np.asarray(a) for a in g.to_moments(q))
        assert np.all(np.abs(m - mean) <= 3 * se), (m, mean, se)
        np.testing.assert_allclose(np.sqrt(np.diag(c)), sd, rtol=0.15)
    assert res.draws is not None and res.draws.shape == (1000, 3)
    np.testing.assert_allclose(res.draws.mean(0), res.mean_and_cov()[0], atol=1e-12)
    assert res.history["bytes_up"][0] > 3 * 1000 * 3 * 8  # the draws travel up with the sites


def test_bad_input(linear):
    clients, _, _ = linear
    with pytest.raises(ValueError, match="method"):
        fedppl.OneShot(linear_regression, _guide(), "average")
    with pytest.raises(ValueError, match="laplace_steps"):
        fedppl.OneShot(linear_regression, _guide(), laplace_steps=0)
    shot = fedppl.OneShot(linear_regression, _guide())
    with pytest.raises(ValueError, match="one round"):
        shot.run(jax.random.key(0), clients, 3)
    first = shot.run(jax.random.key(0), clients)
    with pytest.raises(ValueError, match="starts from the prior"):
        shot.init(jax.random.key(0), clients, first.factors)


def twin_modes(y=None, n=20):
    """``y ~ N(theta^2, 0.3^2)``: with ``y`` near 4 the posterior has modes at -2 and 2 that no
    chain crosses."""
    import numpyro
    import numpyro.distributions as dist

    theta = numpyro.sample("theta", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", n):
        numpyro.sample("y", dist.Normal(theta**2, 0.3), obs=y)


@pytest.mark.parametrize("method", ["parametric", "consensus"])
def test_refuses_to_merge_when_most_chains_did_not_mix(method):
    """Chains stuck in two modes (admitted with max_rhat=inf) are not merged into a narrow
    Gaussian: the run stops with an error naming the clients, their r-hat and what to do."""
    y = 4.0 + 0.3 * np.random.default_rng(0).normal(size=(3, 20))
    clients = fedppl.Clients.from_list([(y_k,) for y_k in y])
    shot = fedppl.OneShot(twin_modes, fedppl.PVIGuide(twin_modes, family="fullrank"), method,
                          num_warmup=100, num_samples=100, num_chains=4, max_rhat=float("inf"),
                          extensions=0)
    with pytest.raises(RuntimeError, match=r"chains of [23] of 3 clients did not mix.*client "
                                           r"\d \(\d.*fedppl.EP"):
        shot.run(jax.random.key(0), clients)


def test_refuses_when_most_clients_are_dropped(linear):
    """Under the default rule the unmixed clients would be left out of q: with most of them out
    the merge is refused as well."""
    clients, _, _ = linear
    shot = fedppl.OneShot(linear_regression, _guide(), "parametric", num_warmup=20,
                          num_samples=20, num_chains=2, max_rhat=1.0 + 1e-12, extensions=0)
    with pytest.raises(RuntimeError, match="3 of 3 clients did not mix"):
        shot.run(jax.random.key(0), clients)
