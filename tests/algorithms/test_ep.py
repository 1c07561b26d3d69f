"""Federated EP (fedppl.algorithms.ep, fedppl.EP): the algebra against closed forms, the
sampled version within its Monte Carlo error, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedppl
from fedppl.algorithms import ep, pvi
from fedppl.families import gaussian as g
from fedppl.models import linear_regression, logistic_regression


def _guide(model=linear_regression):
    return fedppl.PVIGuide(model, family="fullrank")


# -- (b) the algebra: exact tilted moments give the exact posterior ------------------------------


@pytest.mark.parametrize("schedule, damping, alpha, rounds", [
    ("synchronous", 1.0, 1.0, 1), ("synchronous", 1.0, 0.5, 1), ("synchronous", 0.5, 1.0, 50),
    ("sequential", 1.0, 1.0, 1), ("sequential", 0.5, 0.5, 50)])
def test_exact_tilted_is_exact(linear, schedule, damping, alpha, rounds):
    clients, mean, cov = linear
    res = fedppl.EP(linear_regression, _guide(), schedule, damping=damping, alpha=alpha,
                    tilted="exact").run(jax.random.key(0), clients, rounds, progress_bar=False)
    m, c = res.mean_and_cov()
    np.testing.assert_allclose(m, mean, atol=1e-8)
    np.testing.assert_allclose(c, cov, atol=1e-8)
    assert isinstance(res, fedppl.EPResult) and res.rejected == []
    # the largest change of a site's natural parameters: its whole likelihood in round 1
    change = res.history["site_change"]
    assert change.shape == (rounds, 3) and np.all(change[0] > 1.0)
    if rounds > 1:
        assert np.all(change[-1] < 1e-8)


@pytest.mark.parametrize("damping, estimator, end, rate, atol", [
    (ep.decaying_damping(0.5, 0.3), "stein", 0.3, 0.8, 1e-8),
    ("decaying", "sample", 0.2, 0.8, 1e-3),  # ep-stan's: towards min(1 / K, 0.2)
    ("decaying", "stein", 0.1, 0.9, 1e-3)])  # the default estimator's: towards 0.1
def test_decaying_damping_converges(linear, damping, estimator, end, rate, atol):
    """Undamped, a Gaussian site is its likelihood at once: damped, the error shrinks by
    ``1 - rho_r`` a round, ``rho_r = end + (0.5 - end) rate^r``."""
    clients, mean, _ = linear
    res = fedppl.EP(linear_regression, _guide(), damping=damping, estimator=estimator,
                    tilted="exact").run(jax.random.key(0), clients, 40, progress_bar=False)
    np.testing.assert_allclose(res.mean_and_cov()[0], mean, atol=atol)
    np.testing.assert_allclose(res.history["damping"],
                               end + (0.5 - end) * rate ** np.arange(40), rtol=1e-12)


def test_client_step_is_pvi_step_with_tilted_solver(linear):
    """With alpha = 1, EP's client step is PVI's with the tilted moment match as q_k."""
    clients, _, _ = linear
    guide = _guide().setup(*clients.client(0))
    solver = ep.ExactTilted(linear_regression, guide)
    rng = np.random.default_rng(1)
    site = g.FullGaussian(jnp.asarray(rng.normal(size=3)), jnp.diag(jnp.asarray([0.5, 2., 1.])))
    q = g.product(guide.prior, site)
    data = tuple(a[1] for a in clients.stacked)
    ours, new = ep.client_update(q, pvi.ClientState(site), data, clients.mask[1],
                                 jax.random.key(0), solver, 0.5)
    theirs, new_pvi = pvi.client_update(q, pvi.ClientState(site), data, clients.mask[1],
                                        jax.random.key(0), solver, 0.5)
    for a, b in zip(jax.tree_util.tree_leaves((ours.delta, new)),
                    jax.tree_util.tree_leaves((theirs.delta, new_pvi)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-12)


# -- (a) NUTS on the conjugate model: within 3 Monte Carlo standard errors -----------------------


def test_nuts_matches_exact_posterior(linear):
    clients, mean, cov = linear
    # undamped, a Gaussian site is the likelihood plus Monte Carlo noise whatever the cavity, and
    # to first order q's mean errs by the sum of the clients' tilted-mean errors: its s.e. is
    # sd * sqrt(sum_k 1 / ESS_k) (ESS_k the client's smallest over coordinates: conservative)
    res = fedppl.EP(linear_regression, _guide(), damping=1.0, num_warmup=150, num_samples=300,
                    num_chains=2, estimator="sample").run(jax.random.key(3), clients, 2,
                                                          progress_bar=False)
    m, c = res.mean_and_cov()
    ess = res.history["ess"][-1]
    se = np.sqrt(np.diag(cov)) * np.sqrt(np.sum(1.0 / ess))
    assert np.all(np.abs(np.asarray(m) - mean) <= 3 * se), (m, mean, se)
    np.testing.assert_allclose(np.sqrt(np.diag(c)), np.sqrt(np.diag(cov)), rtol=0.15)
    assert np.all(res.history["rhat"] < 1.1) and np.all(res.history["converged"] == 1)
    assert np.all(res.history["mc_error"] == pytest.approx(1 / np.sqrt(res.history["ess"])))


# -- (d) logistic regression: q positive definite and close to the exact posterior --------------


def test_logistic_close_to_posterior():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 2))
    y = (rng.uniform(size=200) < 1 / (1 + np.exp(-(X @ np.array([1.5, -1.0]) + 0.3)))) * 1.0
    clients = fedppl.partition.homogeneous(X, y, num_clients=2, seed=0)
    res = fedppl.EP(logistic_regression, _guide(logistic_regression), num_warmup=150,
                    num_samples=300, num_chains=2).run(jax.random.key(0), clients, 4,
                                                       progress_bar=False)
    m, c = (np.asarray(a) for a in res.mean_and_cov())
    assert np.all(np.linalg.eigvalsh(c) > 0)
    # the pooled posterior's moments by self-normalised importance sampling from a wide
    # Student-t around EP's q (50k draws: its own error is far below the tolerance)
    d = 3
    L = np.linalg.cholesky(2.0 * c)
    z = rng.standard_t(5, size=(50_000, d))
    theta = m + z @ L.T
    log_t = -0.5 * (5 + d) * np.log1p(np.sum(z**2, 1) / 5)
    logits = np.c_[X, np.ones(200)] @ theta.T
    log_post = (np.sum(y[:, None] * logits - np.logaddexp(0, logits), 0)
                - 0.5 * np.sum(theta**2, 1))
    w = np.exp(log_post - log_t - np.max(log_post - log_t))
    w /= w.sum()
    ref_mean = w @ theta
    ref_sd = np.sqrt(w @ (theta - ref_mean) ** 2)
    assert np.all(np.abs(m - ref_mean) < 0.2 * ref_sd), (m, ref_mean, ref_sd)
    np.testing.assert_allclose(np.sqrt(np.diag(c)), ref_sd, rtol=0.2)


# -- (c) bad input, refused before any client runs -----------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": 0.0}, "alpha"), ({"alpha": 1.5}, "alpha"), ({"damping": 0.0}, "damping"),
    ({"damping": 1.5}, "damping"), ({"damping": lambda r: 2.0 + 0 * r}, "damping"),
    ({"damping": "fast"}, "damping"),
    ({"num_samples": 0}, "num_samples"), ({"num_chains": 1.5}, "num_chains"),
    ({"tilted": "laplace"}, "tilted"), ({"schedule": "async"}, "schedule"),
    ({"max_rhat": 1.0}, "max_rhat"), ({"extensions": -1}, "extensions"),
    ({"extensions": 1.5}, "extensions")])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fedppl.EP(linear_regression, _guide(), **kwargs)


def test_too_few_draws(linear):
    clients, _, _ = linear
    with pytest.raises(ValueError, match="at least 16 draws"):
        fedppl.EP(linear_regression, _guide(), num_samples=5, num_chains=2).init(
            jax.random.key(0), clients)


def test_exact_needs_conjugate_model(linear):
    clients, _, _ = linear
    X, y = (np.asarray(a) for a in clients.client(0))
    bad = fedppl.partition.homogeneous(X, (y > 0) * 1.0, num_clients=2, seed=0)
    with pytest.raises(ValueError, match="tilted='exact'"):
        fedppl.EP(logistic_regression, _guide(logistic_regression), tilted="exact").init(
            jax.random.key(0), bad)


def test_unmixed_client_skips_its_update(linear):
    """A client whose r-hat reaches max_rhat keeps its site: here every client, so q stays the
    prior, and the log names each client in each round."""
    clients, _, _ = linear
    guide = _guide()
    with pytest.warns(RuntimeWarning, match="client 0, client 1, client 2 did not mix.*no "
                      "client moved q"):
        res = fedppl.EP(linear_regression, guide, num_warmup=20, num_samples=20, num_chains=2,
                        max_rhat=1.0 + 1e-12).run(jax.random.key(0), clients, 2,
                                                  progress_bar=False)
    prior = guide.prior
    np.testing.assert_array_equal(res.q.nat1, prior.nat1)
    np.testing.assert_array_equal(res.q.prec, prior.prec)
    assert np.all(res.history["converged"] == 0) and np.all(res.history["rhat"] > 1.0)
    assert len(res.unconverged) == 2 * 3 and res.rejected == []


def _far_start(linear, extensions, max_rhat=1.05):
    """Client 0's tilted moments at the prior cavity with chains started far out (q at 50, sd
    0.001, its covariance the first inverse mass matrix) and a warm-up too short to get back:
    ``(moments, exact tilted mean and sd)``."""
    clients, _, _ = linear
    guide = _guide().setup(*clients.client(0))
    prior = guide.prior
    far = g.FullGaussian.from_moments(jnp.full(3, 50.0), 1e-6 * jnp.eye(3))
    solver = ep.TiltedNUTS(linear_regression, guide, num_warmup=5, num_samples=30,
                           num_chains=4, max_rhat=max_rhat, estimator="sample",
                           extensions=extensions)
    data = tuple(a[0] for a in clients.stacked)
    m = jax.jit(solver.moments)(prior, far, data, clients.mask[0], jax.random.key(0))
    exact = ep.ExactTilted(linear_regression, guide).moments(prior, prior, data, clients.mask[0],
                                                             jax.random.key(0))
    mean, cov = g.to_moments(exact.tilted)
    return m, np.asarray(mean), np.sqrt(np.diag(np.asarray(cov)))


def test_extensions_run_unmixed_chains_on_until_they_mix(linear):
    """Chains that have not reached the tilted distribution after the first stage are run on
    (from where they stopped, with their adaptation) until r-hat passes: the moments are then
    the exact tilted ones to Monte Carlo error. Without extensions the same chains fail."""
    stuck, _, _ = _far_start(linear, extensions=0)
    assert float(stuck.rhat) >= 1.05 and int(stuck.extensions) == 0
    m, mean, sd = _far_start(linear, extensions=6)
    assert 1 <= int(m.extensions) <= 6 and float(m.rhat) < 1.05, (m.extensions, m.rhat)
    got_mean, got_cov = g.to_moments(m.tilted)
    assert np.all(np.abs(np.asarray(got_mean) - mean) < 5 * sd / np.sqrt(float(m.ess)))
    np.testing.assert_allclose(np.sqrt(np.diag(np.asarray(got_cov))), sd, rtol=0.3)


def test_extensions_recorded_and_the_budget_respected(linear):
    """A client that never passes (max_rhat just above 1) takes the whole budget each round,
    and the history says so; every client is then skipped."""
    clients, _, _ = linear
    with pytest.warns(RuntimeWarning, match="did not mix"):
        res = fedppl.EP(linear_regression, _guide(), num_warmup=20, num_samples=20,
                        num_chains=2, max_rhat=1.0 + 1e-12, extensions=3).run(
            jax.random.key(0), clients, 1, progress_bar=False)
    np.testing.assert_array_equal(res.history["extensions"], np.full((1, 3), 3.0))
    assert np.all(res.history["converged"] == 0)


def test_local_sites_sampled_at_the_client_and_kept_there():
    """Random intercepts (conjugate, each client one group): the global moments within their
    Monte Carlo error of the exact joint posterior, and each client's private q(a_k | theta),
    fitted to its last joint draws, gives its effect's exact marginal to Monte Carlo error."""
    from tests.reference import unconstrained_moments
    from tests.test_local_sites import exact_posterior, grouped_data, random_intercepts

    parts = grouped_data()
    clients = fedppl.Clients.from_list(parts)
    guide = fedppl.PVIGuide(random_intercepts, global_sites=["mu", "w"], family="fullrank")
    # one undamped round: each site is its likelihood whatever the cavity (conjugate), and a
    # broad cavity (the prior) keeps the sites' Monte Carlo noise small
    res = fedppl.EP(random_intercepts, guide, damping=1.0, num_warmup=200, num_samples=500,
                    num_chains=2).run(jax.random.key(1), clients, 1, progress_bar=False,
                                      n_groups=1)
    mean, cov = exact_posterior(parts)
    m, c = (np.asarray(a) for a in res.mean_and_cov())
    sd = np.sqrt(np.diag(cov))
    se = sd[:3] * np.sqrt(np.sum(1.0 / res.history["ess"][-1]))
    assert np.all(np.abs(m - mean[:3]) <= 3 * se), (m, mean[:3], se)
    np.testing.assert_allclose(np.sqrt(np.diag(c)), sd[:3], rtol=0.15)
    for k in (0, 4):
        a_mean, a_sd = unconstrained_moments(res, client=k)["a"]
        assert abs(float(a_mean[0]) - mean[3 + k]) < 0.15 * sd[3 + k], (a_mean, mean[3 + k])
        assert abs(float(a_sd[0]) / sd[3 + k] - 1) < 0.15, (a_sd, sd[3 + k])
    draws = res.sample(jax.random.key(2), 1000, client=4)
    assert set(draws) == {"mu", "w", "a"} and draws["a"].shape == (1000, 1)
    pytest.importorskip("arviz_base")
    idata = res.to_arviz(num_samples=48)
    assert idata.constant_data["last_rhat"].dims == ("client",)
    np.testing.assert_array_equal(idata.constant_data["last_ess"], res.history["ess"][-1])


def shrinkage(X, y=None):
    """Linear regression with a HalfCauchy scale on the weights: a prior no Gaussian base is."""
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, tau).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


@pytest.fixture(scope="module")
def shrinkage_case():
    """Three clients' data and pooled NUTS's draws of the unconstrained (log tau, w): the one
    reference both estimators below are held against (run once)."""
    from numpyro.infer import MCMC, NUTS

    rng = np.random.default_rng(4)
    X = rng.normal(size=(45, 3))
    y = X @ np.array([0.4, -0.3, 0.2]) + rng.normal(size=45)
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    mcmc = MCMC(NUTS(shrinkage), num_warmup=500, num_samples=3000, num_chains=1,
                progress_bar=False)
    mcmc.run(jax.random.key(0), X, y)
    s = mcmc.get_samples()
    return clients, np.c_[np.log(np.asarray(s["tau"])), np.asarray(s["w"])]


@pytest.mark.parametrize("estimator", ["sample", "stein"])
def test_non_gaussian_prior_enters_exactly(estimator, shrinkage_case):
    """EP with a HalfCauchy scale against pooled NUTS (unconstrained (log tau, w)): the prior's
    departure from its Gaussian base, split over the clients, is what moves log tau there (with
    Stein's estimator, through its gradient and Hessian)."""
    clients, ref = shrinkage_case
    # the sample moments' Monte Carlo floor is higher than Stein's: twice the draws (with
    # 2 x 500 log tau's mean was 0.15 sd off, at the tolerance; with 4 x 500 0.10, Stein's 0.07)
    res = fedppl.EP(shrinkage, fedppl.PVIGuide(shrinkage, family="fullrank"), num_warmup=200,
                    num_samples=500, num_chains=4 if estimator == "sample" else 2,
                    estimator=estimator).run(jax.random.key(0), clients, 8, progress_bar=False)
    layout = res.guide.layout
    order = np.concatenate([np.arange(layout.dim)[layout[n].slice] for n in ("tau", "w")])
    m, c = res.mean_and_cov()
    m, sd = np.asarray(m)[order], np.sqrt(np.diag(np.asarray(c)))[order]
    ref_sd = ref.std(0)
    assert np.all(np.abs(m - ref.mean(0)) < 0.15 * ref_sd), (m, ref.mean(0), ref_sd)
    np.testing.assert_allclose(sd, ref_sd, rtol=0.15)


def test_too_few_draws_message():
    with pytest.raises(ValueError, match="num_samples \\* num_chains = 10"):
        ep.check_draws(10, 3)
    ep.check_draws(16, 3)


# -- Stein's estimator of the tilted moments ----------------------------------------------------


def _tilted_draws(site_prec, D=5, b=0.3, n=400):
    cavity = g.FullGaussian(jnp.zeros(D), jnp.eye(D))
    site = g.FullGaussian(jnp.full(D, site_prec * b), site_prec * jnp.eye(D))
    draws = g.sample(jax.random.key(0), g.product(cavity, site), n).reshape(2, n // 2, D)

    def log_factor(theta):
        return -0.5 * site_prec * jnp.sum((theta - b) ** 2)

    return cavity, site, draws, log_factor


def test_stein_moments_noise_scales_with_the_site():
    """A weak Gaussian site (precision 0.01 against a unit cavity, as one of 100 clients): from
    the same 400 exact tilted draws, Stein's estimate of the site is within 2% of it; the
    sample moments' is off by several times the site itself (both as site precisions). The
    blend keeps Stein's everywhere (no strong direction)."""
    lam = 0.01
    cavity, site, draws, log_factor = _tilted_draws(lam)
    mean, cov, mc = ep.stein_moments(cavity, draws, log_factor, 5)
    est = g.quotient(g.FullGaussian.from_moments(mean, cov), cavity)
    np.testing.assert_allclose(est.prec, site.prec, atol=0.02 * lam)
    # nat1's error is the site's gradient spread over sqrt(n) (lam / 20 here), not sd / 20
    np.testing.assert_allclose(est.nat1, site.nat1, atol=3 * lam / 20)
    assert 0 < float(mc) < 0.01  # the mean's error: the site's gradient spread, not the cavity's
    sample = g.quotient(ep.moments_from_draws(draws.reshape(400, 5), False), cavity)
    assert np.max(np.abs(np.asarray(sample.prec - site.prec))) > 3 * lam  # it can fail
    assert np.max(np.abs(np.asarray(sample.nat1 - site.nat1))) > 3 * lam / 20
    blend, strong = ep.blend_moments(cavity, (mean, cov), draws.reshape(400, 5), 400, False)
    assert int(strong) == 0
    np.testing.assert_allclose(blend.prec, g.FullGaussian.from_moments(mean, cov).prec,
                               rtol=1e-8, atol=1e-12)
    diag, strong = ep.blend_moments(g.project_diag(cavity), (mean, cov), draws.reshape(400, 5),
                                    400, True)
    assert int(strong) == 0
    np.testing.assert_allclose(g.quotient(diag, g.project_diag(cavity)).prec,
                               jnp.diagonal(site.prec), rtol=0.02)


def test_blend_takes_the_draws_where_the_site_dominates():
    """A site five times the cavity's precision along two of five directions: Stein's estimate
    errs there by far more than the draws' covariance (its error grows with the site), which
    errs in the weak directions; the blend finds the two strong directions, takes the draws'
    moments on them and Stein's on the other three, and errs less than either. An estimate that
    is not finite falls back to the draws' moments everywhere."""
    D = 5
    prec = jnp.diag(jnp.array([5.0, 5.0, 0.01, 0.01, 0.01]))
    cavity = g.FullGaussian(jnp.zeros(D), jnp.eye(D))
    site = g.FullGaussian(prec @ jnp.full(D, 0.3), prec)
    exact_mean, exact_cov = g.to_moments(g.product(cavity, site))
    draws = g.sample(jax.random.key(1), g.product(cavity, site), 400).reshape(2, 200, D)

    def log_factor(theta):
        return -0.5 * (theta - 0.3) @ prec @ (theta - 0.3)

    def err(c):
        return float(np.max(np.abs(np.asarray(c) - np.asarray(exact_cov))))

    mean, cov, _ = ep.stein_moments(cavity, draws, log_factor, D)
    flat = draws.reshape(400, D)
    blend, strong = ep.blend_moments(cavity, (mean, cov), flat, 400, False)
    assert int(strong) == 2
    got_mean, got_cov = g.to_moments(blend)
    sample = g.to_moments(ep.moments_from_draws(flat, False))[1]
    # Stein's 0.39, the draws' 0.15, the blend's 0.04 (largest error in a covariance entry)
    assert err(got_cov) < 0.5 * min(err(cov), err(sample)), (err(got_cov), err(cov), err(sample))
    np.testing.assert_allclose(got_mean, exact_mean, atol=0.1)
    nan, strong = ep.blend_moments(cavity, (mean * jnp.nan, cov), flat, 400, False)
    assert int(strong) == D and bool(g.is_pd(nan))
    np.testing.assert_allclose(g.to_moments(nan)[0], np.mean(flat, 0), atol=1e-10)
    np.testing.assert_allclose(g.to_moments(nan)[1], np.cov(flat.T) * 399 / (400 - D - 2),
                               rtol=1e-8)
