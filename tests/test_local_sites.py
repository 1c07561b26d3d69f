"""Local latent sites: each client's random effects get a private guide that never leaves it.

The conjugate case has an exact answer (a joint Gaussian over the global sites and every
client's effects); the logistic case is compared with pooled-data VI in the same family: fedppl's
``GlobalVI`` on the pooled data (every group's effect in one joint; PVI must reach its fixed
point up to Monte Carlo error: its joint has other dimensions, so other fixed draws) and
numpyro's ``SVI`` with ``AutoMultivariateNormal``; both within the Monte Carlo tolerance of
``tests/test_priors.py`` (0.1 posterior sd in means, 5% in sds).
"""

from __future__ import annotations

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedppl
from fedppl.guides import PVIGuide
from tests.reference import unconstrained_moments, worst_gap

TAU, SIGMA = 0.5, 0.3


def random_intercepts(X, gid, y=None, *, n_groups):
    """Gaussian regression with one intercept per group, known variances (conjugate)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", dist.Normal(mu, TAU))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + a[gid], SIGMA), obs=y)


def logistic_intercepts(X, gid, y=None, *, n_groups):
    """Logistic regression with group intercepts, a HalfCauchy group scale."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", dist.Normal(mu, tau))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + a[gid]), obs=y)


def grouped_data(K=6, D=2, logistic=False, seed=0):
    rng = np.random.default_rng(seed)
    parts = []
    for k in range(K):
        n = 15 + 9 * k if not logistic else 40 + 25 * k
        X = rng.normal(size=(n, D)) + 0.3 * k
        effect = 0.8 + TAU * rng.normal()
        f = X @ np.linspace(0.5, -1.0, D) + effect
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-f))).astype(float) if logistic else \
            f + SIGMA * rng.normal(size=n)
        parts.append((X, np.zeros(n, int), y))
    return parts


def pooled(parts):
    X = np.concatenate([p[0] for p in parts])
    gid = np.concatenate([np.full(len(p[2]), k) for k, p in enumerate(parts)])
    y = np.concatenate([p[2] for p in parts])
    return X, gid, y


def exact_posterior(parts):
    """The joint Gaussian posterior over (mu, w, a_1..a_K)."""
    K, D = len(parts), parts[0][0].shape[1]
    P = 1 + D + K
    prec, h = np.zeros((P, P)), np.zeros(P)
    prec[0, 0] += 1.0
    prec[1:1 + D, 1:1 + D] += np.eye(D)
    for k, (X, _, y) in enumerate(parts):
        v = np.zeros(P)
        v[1 + D + k], v[0] = 1.0, -1.0
        prec += np.outer(v, v) / TAU**2
        A = np.zeros((len(y), P))
        A[:, 1:1 + D], A[:, 1 + D + k] = X, 1.0
        prec += A.T @ A / SIGMA**2
        h += A.T @ y / SIGMA**2
    cov = np.linalg.inv(prec)
    return cov @ h, cov


@pytest.mark.parametrize("schedule", ["sequential", "synchronous"])
def test_conjugate_random_intercepts_are_exact(schedule):
    parts = grouped_data()
    clients = fedppl.Clients.from_list(parts)
    guide = PVIGuide(random_intercepts, global_sites=["mu", "w"], family="fullrank")
    res = fedppl.PVI(random_intercepts, guide, schedule).run(
        jax.random.key(0), clients, 5, progress_bar=False, n_groups=1)
    mean, cov = exact_posterior(parts)
    m, c = res.mean_and_cov()
    np.testing.assert_allclose(m, mean[:3], atol=1e-6)
    np.testing.assert_allclose(c, cov[:3, :3], atol=1e-6)
    # each client's private guide is its effect's exact conditional: joint moments match
    for k in (0, 4):
        local = unconstrained_moments(res, client=k)["a"]
        np.testing.assert_allclose(local[0], mean[3 + k], atol=1e-6)
        np.testing.assert_allclose(local[1], np.sqrt(cov[3 + k, 3 + k]), atol=1e-6)
    draws = res.sample(jax.random.key(1), 4000, client=4)
    assert set(draws) == {"mu", "w", "a"} and draws["a"].shape == (4000, 1)
    assert abs(float(draws["a"].mean()) - mean[7]) < 4 * np.sqrt(cov[7, 7] / 4000)


def test_groups_a_client_holds_no_data_for_change_nothing():
    """Every client carries all K groups (one shape everywhere), with data for its own only: the
    others are marginalised out exactly, so the answer is the one-group-per-client one."""
    parts = grouped_data()
    padded = [(X, np.full(len(y), k), y) for k, (X, _, y) in enumerate(parts)]
    guide = PVIGuide(random_intercepts, global_sites=["mu", "w"], family="fullrank")
    res = fedppl.PVI(random_intercepts, guide).run(
        jax.random.key(0), fedppl.Clients.from_list(padded), 5, progress_bar=False,
        n_groups=len(parts))
    mean, cov = exact_posterior(parts)
    np.testing.assert_allclose(res.mean_and_cov()[0], mean[:3], atol=1e-6)
    np.testing.assert_allclose(res.mean_and_cov()[1], cov[:3, :3], atol=1e-6)
    own = unconstrained_moments(res, client=2)["a"]
    np.testing.assert_allclose(own[0][2], mean[5], atol=1e-6)
    np.testing.assert_allclose(own[1][2], np.sqrt(cov[5, 5]), atol=1e-6)
    # the groups it holds no data for: a new group's posterior, N(mu, TAU) given each draw of
    # mu, so mean E[mu] and variance Var(mu) + TAU^2 (not the N(0, 1) the local step used)
    draws = np.asarray(res.sample(jax.random.key(2), 20000, client=2)["a"])
    others = np.delete(draws, 2, axis=1)
    sd = np.sqrt(cov[0, 0] + TAU**2)
    assert np.all(np.abs(others.mean(0) - mean[0]) < 4 * sd / np.sqrt(20000))
    assert np.all(np.abs(others.std(0) / sd - 1) < 4 / np.sqrt(2 * 20000))


def test_independent_local_guide_understates_global_uncertainty():
    """The documented cost of local='independent': q(theta) q(z) misses their correlation."""
    parts = grouped_data()
    clients = fedppl.Clients.from_list(parts)
    guide = PVIGuide(random_intercepts, global_sites=["mu", "w"], family="fullrank",
                     local="independent")
    res = fedppl.PVI(random_intercepts, guide).run(jax.random.key(0), clients, 30,
                                                   progress_bar=False, tol=1e-12, n_groups=1)
    _, cov = exact_posterior(parts)
    ratio = np.sqrt(np.diag(res.mean_and_cov()[1]) / np.diag(cov)[:3])
    assert np.all(ratio < 1.0) and ratio.min() < 0.9


@pytest.fixture(scope="module")
def logistic_case():
    parts = grouped_data(K=5, D=3, logistic=True, seed=1)
    clients = fedppl.Clients.from_list(parts)
    guide = PVIGuide(logistic_intercepts, global_sites=["mu", "tau", "w"], family="fullrank")
    res = fedppl.PVI(logistic_intercepts, guide, "sequential").run(
        jax.random.key(0), clients, 40, progress_bar=False, tol=1e-12, n_groups=1)
    return parts, clients, res


def test_logistic_random_intercepts_reach_pooled_vi(logistic_case):
    parts, _, res = logistic_case
    ref = fedppl.GlobalVI(logistic_intercepts,
                          PVIGuide(logistic_intercepts, global_sites=["mu", "tau", "w"],
                                   family="fullrank")).run(jax.random.key(0), pooled(parts),
                                                           n_groups=len(parts))
    ours, theirs = unconstrained_moments(res), unconstrained_moments(ref, client=0)
    # not equal to round-off: the pooled joint has other dimensions, so other fixed draws
    mean_gap, sd_gap = worst_gap(ours, {n: theirs[n] for n in ("mu", "tau", "w")})
    assert mean_gap < 0.1 and sd_gap < 0.05, (mean_gap, sd_gap)
    # client k's effect is the pooled joint's k-th group effect
    for k in range(len(parts)):
        a = unconstrained_moments(res, client=k)["a"]
        np.testing.assert_allclose(a[0], theirs["a"][0][k], atol=0.1 * theirs["a"][1][k])
        np.testing.assert_allclose(a[1], theirs["a"][1][k], rtol=0.05)


def test_local_sites_in_arviz_have_a_client_dimension(logistic_case):
    pytest.importorskip("arviz_base")
    _, clients, res = logistic_case
    idata = res.to_arviz(jax.random.key(0), num_samples=200)
    a = idata.posterior["a"]
    assert a.dims[:3] == ("chain", "draw", "client")
    assert list(a.coords["client"].values) == list(clients.names)
    assert idata.posterior["tau"].shape == (4, 50)


def test_local_site_shapes_must_agree():
    parts = grouped_data(K=3)

    def by_rows(X, gid, y=None):  # one effect per data row: shape follows the client's size
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("groups", X.shape[0] // 10):
            a = numpyro.sample("a", dist.Normal(mu, 1.0))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(a[gid], 1.0), obs=y)

    guide = PVIGuide(by_rows, global_sites=["mu"])
    with pytest.raises(ValueError, match=r"local site 'a' has shape .* for client 1"):
        fedppl.PVI(by_rows, guide).run(jax.random.key(0), fedppl.Clients.from_list(parts), 1,
                                       progress_bar=False)


def test_solvers_without_local_support_say_so():
    clients = fedppl.Clients.from_list(grouped_data(K=2))
    guide = PVIGuide(random_intercepts, global_sites=["mu", "w"])
    with pytest.raises(ValueError, match="solver='optax' is not available: the model has local"):
        fedppl.PVI(random_intercepts, guide, solver="optax").run(
            jax.random.key(0), clients, 1, progress_bar=False, n_groups=1)
    with pytest.raises(ValueError, match="conjugate=True is not available: the model has local"):
        fedppl.PVI(random_intercepts, guide, conjugate=True).run(
            jax.random.key(0), clients, 1, progress_bar=False, n_groups=1)
