"""The federated SMC sampler (``fedppl.SMC``, ``result.refine``) against exact posteriors:
random intercepts with a weakly identified scale (local sites whose marginal likelihood is
Gaussian: the importance estimates are exact) against a quadrature, Bayesian linear regression
(no local sites) from a start that is off on purpose, in float64 and float32; how ``refine``
chooses; faults; the ArviZ export; and bad input, refused before any client computes."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedppl
from fedppl.families import gaussian as g
from fedppl.infer.importance import ImportanceResult
from fedppl.infer.smc import SMCResult
from fedppl.runtime.faults import Faults
from tests.conftest import exact_linear_posterior, linear_model, random_intercepts
from tests.reference import grid_posterior

N, ISLANDS = 400, 20  # the islands' spread (19 degrees of freedom) is the Monte Carlo error


def _groups(seed: int, J: int = 16, n: int = 4, dtype=np.float64):
    rng = np.random.default_rng(seed)
    a = 0.3 * rng.normal(size=J)
    groups = [(0.5 + a[j] + rng.normal(size=n)).astype(dtype) for j in range(J)]
    parts = [(np.repeat([0, 1], n), np.concatenate([groups[2 * k], groups[2 * k + 1]]))
             for k in range(J // 2)]
    return groups, fedppl.Clients.from_list(parts)


def _within_mc_error(result: SMCResult, mean: np.ndarray, sd: np.ndarray, slack: float = 0.0):
    """The particles' mean and sd within 4.5 of their stated Monte Carlo errors (plus ``slack``
    sd) of the exact ones: with 20 islands a stated error is a t with 19 degrees of freedom,
    beyond 4.5 with probability 2e-4 (the errors' calibration, over 20 runs of the linear task
    below: z-scores with sd 0.94)."""
    m, c = result.mean_and_cov()
    s = np.sqrt(np.diag(c))
    se = result.mcse()
    assert np.all(np.abs(m - mean) <= 4.5 * se["mean"] + slack * sd), (m, mean, se["mean"])
    assert np.all(np.abs(s - sd) <= 4.5 * se["sd"] + slack * sd), (s, sd, se["sd"])
    assert np.all(se["mean"] < 0.15 * sd)  # and the error stated is small


@pytest.fixture(scope="module")
def intercepts():
    """Sixteen groups on eight clients (two each), a weak group scale: PVI's Gaussian cannot
    carry the skew of log tau; the exact posterior of ``(mu, log tau)`` by quadrature."""
    groups, clients = _groups(3)
    guide = fedppl.PVIGuide(random_intercepts, ("mu", "tau"), family="fullrank")
    res = fedppl.PVI(random_intercepts, guide).run(jax.random.key(0), clients, 6,
                                                   progress_bar=False, n_groups=2)
    out = res.refine(jax.random.key(1), clients, num_particles=N, islands=ISLANDS,
                     local_draws=2, progress_bar=False)
    return res, clients, grid_posterior(groups), out


def test_random_intercepts_reach_the_exact_posterior(intercepts):
    """Local sites: refine chooses the sampler and says why; its moments are the quadrature's
    within their stated Monte Carlo error; the run reached temperature 1 and renewed there."""
    res, clients, (mean, sd), out = intercepts
    assert isinstance(out, SMCResult) and "local sites" in out.chosen
    assert out.reached and out.renewed >= 0.9 and out.stopped is not None
    _within_mc_error(out, mean, sd)
    q_mean = res.mean_and_cov()[0]
    q_err = np.max(np.abs(np.asarray(q_mean) - mean) / sd)
    m = out.mean_and_cov()[0]
    assert np.max(np.abs(m - mean) / sd) < max(0.1, 0.5 * q_err)  # closer than PVI's
    h = out.history
    assert np.all(np.diff(h["beta"]) >= 0) and h["beta"][-1] == 1.0
    assert h["done"][-1] == 1 and not np.any(h["done"][:-1])
    assert np.all(h["rejected"] == 0) and out.rejected == []
    K = clients.num_clients
    # per round each client sends 2 N log-likelihoods (and its refreshes' acceptance rate and
    # its estimates' median variance) and is sent particles, proposals, ancestors, the
    # temperature and which proposals are independent: nothing else leaves either side
    assert np.all(h["bytes_up"] == K * (2 * N * 8 + 2 * 8))
    assert np.all(h["bytes_down"] == K * (2 * N * 2 * 8 + N * 4 + 8 + 1 + N))
    assert np.all(h["refreshed"] > 0.99)  # exact estimates: every refresh is accepted
    assert np.all(h["local_sd"] < 1e-5) and out.summary()["local_sd"] < 1e-5  # and no noise
    # the islands are the chains of the ArviZ export, the rounds' diagnostics beside them
    tree = out.to_arviz()
    assert tree.posterior["mu"].shape == (ISLANDS, N // ISLANDS)
    assert tree.sample_stats["beta"].dims == ("round",)
    assert float(tree.sample_stats["beta"][-1]) == 1.0
    draws = out.sample(jax.random.key(2), 300)
    assert draws["tau"].shape == (300,) and np.all(np.asarray(draws["tau"]) > 0)


@pytest.mark.parametrize("gradient", [False, True])
def test_random_intercepts_in_float32(gradient):
    """The same in float32 (data, PVI and the sampler; with the gradient moves too, the
    clients' Laplace gradients in float32): the quadrature's moments within the stated Monte
    Carlo error and 0.05 sd."""
    with jax.enable_x64(False):
        groups, clients = _groups(3, dtype=np.float32)
        guide = fedppl.PVIGuide(random_intercepts, ("mu", "tau"), family="fullrank")
        res = fedppl.PVI(random_intercepts, guide).run(jax.random.key(0), clients, 6,
                                                       progress_bar=False, n_groups=2)
        out = res.refine(jax.random.key(1), clients, num_particles=N, islands=ISLANDS,
                         local_draws=2, gradient=gradient, progress_bar=False)
        assert out.particles.dtype == np.float32 and out.reached
        mean, sd = grid_posterior([g_.astype(np.float64) for g_ in groups])
        _within_mc_error(out, mean, sd, slack=0.05)


@pytest.fixture(scope="module")
def linear():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(150, 3))
    y = X @ np.array([1.0, -0.5, 0.3]) + 0.5 * rng.normal(size=150)
    clients = fedppl.partition.homogeneous(X, y, num_clients=4, seed=0)
    res = fedppl.PVI(linear_model, fedppl.PVIGuide(linear_model, family="fullrank")).run(
        jax.random.key(0), clients, 2, progress_bar=False)
    return res, clients, *exact_linear_posterior(X, y)


def test_no_local_sites_from_a_start_that_is_off(linear):
    """No local sites: each client's log-likelihood is exact. From q shifted by one sd and
    half as wide (the check flags it), refine chooses the sampler and lands on the closed
    form within the stated Monte Carlo error."""
    res, clients, mean, cov = linear
    sd = np.sqrt(np.diag(cov))
    off = dataclasses.replace(res, q=g.FullGaussian.from_moments(mean + sd, cov / 4))
    out = off.refine(jax.random.key(1), clients, num_particles=N, islands=ISLANDS,
                     progress_bar=False)
    assert isinstance(out, SMCResult) and "check flags q" in out.chosen
    assert out.history["stage"][-1] >= 2  # it had to temper
    _within_mc_error(out, mean, sd)
    assert np.all(out.history["refreshed"] == 1.0)  # nothing to refresh
    assert np.all(out.history["local_sd"] == 0.0)  # exact log-likelihoods
    # stop=False: every round asked for, past the stopping rule (which fired above)
    assert out.num_rounds < 25
    longer = off.refine(jax.random.key(1), clients, 25, num_particles=N, islands=ISLANDS,
                        stop=False, progress_bar=False)
    assert longer.num_rounds == 25 and longer.stopped is None
    np.testing.assert_array_equal(longer.history["beta"][:out.num_rounds], out.history["beta"])
    _within_mc_error(longer, mean, sd)
    # an answer the check passes is refined by importance, as before
    exact = res.refine(jax.random.key(1), clients, progress_bar=False)
    assert isinstance(exact, ImportanceResult) and "importance" in exact.chosen


def test_pooled_steps_reach_the_closed_form_in_fewer_rounds(linear):
    """``pool_steps``: from the same off start, more particles move per round, temperature 1
    comes no later, and after the rounds the particles are the closed form's within their
    stated Monte Carlo error."""
    res, clients, mean, cov = linear
    sd = np.sqrt(np.diag(cov))
    off = g.FullGaussian.from_moments(mean + sd, cov / 4)
    runs = [fedppl.SMC(linear_model, res.guide, off, num_particles=N, islands=ISLANDS,
                       pool_steps=steps).run(jax.random.key(1), clients, 20, stop=False,
                                             progress_bar=False, warn=False)
            for steps in (0, 16)]
    first = [int(np.argmax(r.history["beta"] >= 1)) for r in runs]
    assert all(r.reached for r in runs) and first[1] <= first[0]
    moved = [np.nanmean(r.history["accepted"]) for r in runs]
    assert moved[1] > moved[0] + 0.1
    _within_mc_error(runs[1], mean, sd)


@pytest.mark.parametrize("gradient, persistence, crank_nicolson",
                         [(False, 0.0, False), (True, 0.0, False), (True, 0.9, False),
                          (False, 0.0, True)])
def test_float32_without_local_sites(gradient, persistence, crank_nicolson):
    """float32 (x64 off) through the sampler: the closed form within the stated Monte Carlo
    error and 0.05 sd, with the default walk, Langevin steps, a persistent walk with its
    acceptance uniform carried (the server's momenta and uniforms in float32), or
    Crank-Nicolson steps around the fit."""
    with jax.enable_x64(False):
        rng = np.random.default_rng(0)
        X = rng.normal(size=(150, 3)).astype(np.float32)
        y = (X @ np.array([1.0, -0.5, 0.3]) + 0.5 * rng.normal(size=150)).astype(np.float32)
        clients = fedppl.partition.homogeneous(X, y, num_clients=4, seed=0)
        res = fedppl.PVI(linear_model, fedppl.PVIGuide(linear_model, family="fullrank")).run(
            jax.random.key(0), clients, 2, progress_bar=False)
        mean, cov = exact_linear_posterior(X.astype(np.float64), y.astype(np.float64))
        sd = np.sqrt(np.diag(cov))
        start = g.FullGaussian.from_moments((mean + sd).astype(np.float32),
                                            (cov / 4).astype(np.float32))
        out = fedppl.SMC(linear_model, res.guide, start, num_particles=N, islands=ISLANDS,
                         gradient=gradient, persistence=persistence,
                         uniform_step=0.05 if persistence else 0.0,
                         crank_nicolson=crank_nicolson
                         ).run(jax.random.key(1), clients, progress_bar=False)
        assert out.particles.dtype == np.float32 and out.reached
        _within_mc_error(out, mean, sd, slack=0.05)


def test_noisy_local_estimates_are_measured_and_warned_about(monkeypatch):
    """A logistic random intercept's marginal likelihood has no closed form: the clients'
    estimates are noisy (a little: a one-dimensional Laplace fit is close), ``local_sd``
    measures it (exactly 0 for the Gaussian intercepts above), and the run warns where it is
    above ``LOCAL_SD_WARN`` (lowered here to fire on a small task)."""
    import fedppl.infer.smc as smc_mod
    from tests.conftest import random_intercepts_logit

    rng = np.random.default_rng(1)
    parts = [(np.repeat([0, 1], 6), (rng.uniform(size=12) < 0.6).astype(float))
             for _ in range(6)]
    clients = fedppl.Clients.from_list(parts)
    guide = fedppl.PVIGuide(random_intercepts_logit, ("mu", "tau"), family="fullrank")
    guide.setup(*clients.client(0), n_groups=2)
    smc = fedppl.SMC(random_intercepts_logit, guide, guide.prior, num_particles=100,
                     islands=5, local_draws=8)
    monkeypatch.setattr(smc_mod, "LOCAL_SD_WARN", 1e-4)
    with pytest.warns(UserWarning, match="estimates of their marginal likelihoods are noisy"):
        out = smc.run(jax.random.key(0), clients, 2, progress_bar=False, n_groups=2)
    assert np.all((out.history["local_sd"] > 1e-4) & (out.history["local_sd"] < 1.0))
    monkeypatch.setattr(smc_mod, "LOCAL_SD_WARN", 1.0)  # the default: quiet here
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*noisy.*")
        smc.run(jax.random.key(0), clients, 2, progress_bar=False, warn=True, n_groups=2)


def test_a_client_whose_messages_are_corrupted_voids_the_round_and_nothing_else(linear):
    """NaN, +inf, huge and improper messages are refused (the round is void: no particle
    moves, no client keeps its refresh) and recorded by client; the run goes on and reaches
    the closed form."""
    res, clients, mean, cov = linear
    sd = np.sqrt(np.diag(cov))
    off = g.FullGaussian.from_moments(mean + sd, cov / 4)
    smc = fedppl.SMC(linear_model, res.guide, off, num_particles=N, islands=ISLANDS)
    faults = Faults(corrupt=0.08, seed=3)
    out = smc.run(jax.random.key(1), clients, 40, progress_bar=False, runtime=faults)
    bad = {(r, clients.names[k]) for r, k, f in faults.events}
    assert bad and {(r, who) for r, who, _ in out.rejected} == bad
    for r in {r for r, _ in bad} - {1}:  # a void round moves no particle
        assert out.history["accepted"][r - 1] == 0
    assert out.reached
    _within_mc_error(out, mean, sd)


@pytest.mark.parametrize("steps", [1, 16])
def test_pool_moves_leave_the_target_invariant(steps):
    """Particles distributed as the target stay so after the pooled independence steps (the
    target N(0, 1), the proposals N(0.5, 1.5^2), half of them usable); a kernel that left the
    proposal's density out of the ratio would pull them to N(0.15, 0.69), the product."""
    from jax.scipy.stats import norm

    from fedppl.algorithms.smc_kernels import pool_moves

    kx, kc, ku, kp = jax.random.split(jax.random.key(0), 4)
    n = 20_000
    x = jax.random.normal(kx, (n,))
    c = 0.5 + 1.5 * jax.random.normal(kc, (n,))

    def log_w(v):
        return norm.logpdf(v) - norm.logpdf(v, 0.5, 1.5)

    usable = jax.random.uniform(ku, (n,)) < 0.5
    pick = np.asarray(pool_moves(kp, log_w(x), log_w(c), usable, islands=10, steps=steps))
    moved = pick >= 0
    assert 0.2 < moved.mean() < 1  # they move, to usable proposals of their own island only
    assert np.all(np.asarray(usable)[pick[moved]])
    assert np.all(pick[moved] // (n // 10) == np.flatnonzero(moved) // (n // 10))
    assert np.all(pick != np.arange(n))
    after = np.where(moved, np.asarray(c)[pick], np.asarray(x))
    # particles that moved to one proposal are copies: allow for an effective size of n / 4
    se = 1 / np.sqrt(n / 4)
    assert abs(after.mean()) < 4 * se and abs(after.var() - 1) < 4 * np.sqrt(2) * se


def _walk(log_p, x0, key, steps, chol, h, persistence, carried, faithful=True):
    """``steps`` leapfrog steps of the sampler's walk (:mod:`fedppl.algorithms.smc_kernels`)
    for particles ``x0`` at the log density ``log_p`` (one row), from standard normal momenta
    and uniform carried values: the particles, their momenta and each step's acceptances. With
    ``faithful=False`` the ratio leaves out the kinetic energy (a wrong walk)."""
    from fedppl.algorithms.smc_kernels import carried_accept, kick, propose, walk_end

    n, D = x0.shape
    lp, grad = jax.vmap(log_p), jax.vmap(jax.grad(log_p))
    k_u0, k_lift, k_steps = jax.random.split(key, 3)

    def step(carry, key):
        x, u, lift = carry
        k_prop, k_u = jax.random.split(key)
        there = kick(grad(x), chol, h)
        y, kind, u = propose(k_prop, x, jnp.zeros(D), chol, h, (1.0,), 0.0, u, persistence,
                             there)
        u_new, kinetic = walk_end(u, there, kick(grad(y), chol, h))
        ratio = lp(y) - lp(x) + (kinetic if faithful else 0.0)
        if carried:
            ok, lift = carried_accept(ratio, lift, carried)
        else:
            ok = jnp.log(jax.random.uniform(k_u, (n,))) < ratio
        return ((jnp.where(ok[:, None], y, x), jnp.where(ok[:, None], u_new, -u), lift),
                (ok, jnp.all(kind == 0)))

    start = (x0, jax.random.normal(k_u0, (n, D)),
             jax.random.uniform(k_lift, (n,), minval=-1.0, maxval=1.0))
    (x, u, _), (ok, walks) = jax.lax.scan(step, start, jax.random.split(k_steps, steps))
    assert bool(jnp.all(walks))  # no independence proposals: every move is the walk's
    return np.asarray(x), np.asarray(u), np.asarray(ok)


@pytest.mark.parametrize("persistence, carried", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.1)])
@pytest.mark.parametrize("faithful", [True, False])
def test_the_leapfrog_walk_leaves_the_target_invariant(persistence, carried, faithful):
    """Particles distributed as the target (a correlated 2-d Gaussian) stay so after five
    leapfrog steps preconditioned by a covariance that is not the target's, with a fresh
    momentum each step (a Langevin step) or 0.9 of it kept (a rejected particle turns back),
    and with a fresh uniform each step or one carried (:func:`carried_accept`); a ratio that
    left out the kinetic energy (the kicks make it change) would not: that one is checked to
    fail, so the test can."""
    from jax.scipy.stats import multivariate_normal as mvn

    m, S = jnp.asarray([1.0, -1.0]), jnp.asarray([[1.0, 0.8], [0.8, 1.0]])
    chol = jnp.linalg.cholesky(jnp.asarray([[2.0, 0.0], [0.0, 0.5]]))
    n = 20_000
    x0 = jax.random.multivariate_normal(jax.random.key(0), m, S, (n,))
    x, u, ok = _walk(lambda x: mvn.logpdf(x, m, S), x0, jax.random.key(1), 5, chol, 0.8,
                     persistence, carried, faithful)
    assert 0.2 < ok.mean() < 0.95
    se = 1 / np.sqrt(n / 4)  # five steps of one chain per particle: generous
    off = max(np.max(np.abs(x.mean(0) - np.asarray(m))),
              np.max(np.abs(np.cov(x.T) - np.asarray(S))) / np.sqrt(2))
    assert (off < 4 * se) == faithful, off
    if faithful:  # the momenta stay standard normal, uncorrelated with the positions
        c = np.cov(np.hstack([x, u]).T)
        assert np.max(np.abs(c[2:, 2:] - np.eye(2))) < 4 * np.sqrt(2) * se
        assert np.max(np.abs(c[2:, :2])) < 4 * se


@pytest.mark.parametrize("faithful", [True, False])
def test_the_crank_nicolson_walk_leaves_the_target_invariant(faithful):
    """Particles distributed as a correlated 2-d Gaussian stay so after five Crank-Nicolson
    steps around a Gaussian that is not the target's (another centre and covariance), with
    its ratio (:func:`crank_nicolson_ratio`); a ratio without the fit's term would not: that
    one is checked to fail, so the test can."""
    from jax.scipy.stats import multivariate_normal as mvn

    from fedppl.algorithms.smc_kernels import crank_nicolson_ratio, propose

    m, S = jnp.asarray([1.0, -1.0]), jnp.asarray([[1.0, 0.8], [0.8, 1.0]])
    centre, chol = jnp.asarray([0.5, 0.0]), jnp.linalg.cholesky(jnp.asarray([[2.0, 0.0],
                                                                             [0.0, 0.5]]))
    n = 20_000
    x = jax.random.multivariate_normal(jax.random.key(0), m, S, (n,))
    u, oks = jnp.zeros_like(x), []
    for key in jax.random.split(jax.random.key(1), 5):
        k_prop, k_u = jax.random.split(key)
        y, kind, _ = propose(k_prop, x, centre, chol, jnp.asarray(0.8), (1.0,), 0.0, u,
                             crank_nicolson=True)
        ratio = mvn.logpdf(y, m, S) - mvn.logpdf(x, m, S)
        if faithful:
            ratio = ratio + crank_nicolson_ratio(x, y, centre, chol)
        ok = jnp.log(jax.random.uniform(k_u, (n,))) < ratio
        x = jnp.where(ok[:, None], y, x)
        oks.append(float(ok.mean()))
        assert bool(jnp.all(kind == 0))
    assert 0.2 < np.mean(oks) < 0.95
    x = np.asarray(x)
    se = 1 / np.sqrt(n / 4)
    off = max(np.max(np.abs(x.mean(0) - np.asarray(m))),
              np.max(np.abs(np.cov(x.T) - np.asarray(S))) / np.sqrt(2))
    assert (off < 4 * se) == faithful, off


def test_persistent_momentum_and_a_carried_uniform_mix_faster():
    """On a target with one direction eight times wider than the preconditioner says (10-d,
    at the target from the start), 30 leapfrog steps of the same length leave the wide
    coordinate correlated with its start at 0.8 or more with a fresh momentum each step
    (Langevin steps diffuse), far less with 0.97 of it kept, and less again with the uniform
    carried as well (rejections in runs turn the particles back less often): the reasons for
    ``persistence`` and ``uniform_step``. Each run stays at the target."""
    n, D = 4000, 10
    sd = jnp.ones(D).at[0].set(8.0)
    x0 = sd * jax.random.normal(jax.random.key(0), (n, D))

    def run(persistence, carried):
        x, _, ok = _walk(lambda x: -0.5 * jnp.sum((x / sd)**2), x0, jax.random.key(3), 30,
                         jnp.eye(D), 0.9, persistence, carried)
        assert abs(x[:, 0].std() / 8 - 1) < 0.06 and 0.6 < ok.mean() < 0.95
        return float(np.corrcoef(x[:, 0], np.asarray(x0[:, 0]))[0, 1])

    langevin, persistent, carried = run(0.0, 0.0), run(0.97, 0.0), run(0.97, 0.03)
    assert langevin > 0.8 and persistent < langevin - 0.25 and carried < persistent - 0.2, (
        langevin, persistent, carried)


@pytest.mark.parametrize("persistence, uniform_step", [(0.0, 0.0), (0.9, 0.0), (0.95, 0.05)])
def test_gradient_moves_reach_the_closed_form(linear, persistence, uniform_step):
    """``gradient=True`` without local sites (each client's exact gradient): from the off
    start, the closed form within the stated Monte Carlo error, with a fresh momentum each
    round (Langevin steps) or most of it kept (the server's momenta, resampled with their
    particles), and with the acceptance uniforms carried; each client also sends its gradient
    at every proposal, ``N D`` numbers more a round, and nothing more with persistence."""
    res, clients, mean, cov = linear
    sd = np.sqrt(np.diag(cov))
    off = g.FullGaussian.from_moments(mean + sd, cov / 4)
    out = fedppl.SMC(linear_model, res.guide, off, num_particles=N, islands=ISLANDS,
                     gradient=True, persistence=persistence, uniform_step=uniform_step,
                     rw_target=0.6 if persistence else 0.3
                     ).run(jax.random.key(1), clients, 20, stop=False, progress_bar=False,
                           warn=False)
    assert out.reached and np.nanmean(out.history["accepted"]) > 0.3
    _within_mc_error(out, mean, sd)
    D, K = len(mean), clients.num_clients
    assert np.all(out.history["bytes_up"] == K * ((2 + D) * N * 8 + 2 * 8))


def test_crank_nicolson_walk_reaches_the_closed_form(linear):
    """``crank_nicolson=True``: from the off start, the closed form within the stated Monte
    Carlo error; on a Gaussian target the fit is near the target, so the step grows long and
    more is accepted at temperature 1 than the random walk's target."""
    res, clients, mean, cov = linear
    sd = np.sqrt(np.diag(cov))
    off = g.FullGaussian.from_moments(mean + sd, cov / 4)
    out = fedppl.SMC(linear_model, res.guide, off, num_particles=N, islands=ISLANDS,
                     crank_nicolson=True, independent=0.0).run(
        jax.random.key(1), clients, 15, stop=False, progress_bar=False, warn=False)
    assert out.reached
    at_one = out.history["beta"] >= 1
    assert np.mean(out.history["accepted"][at_one][-5:]) > 0.5
    _within_mc_error(out, mean, sd)


def test_gradient_moves_with_local_sites(intercepts):
    """``gradient=True`` with local sites (the clients' gradients of their Laplace
    approximations): the quadrature's moments within the stated Monte Carlo error, as
    without."""
    res, clients, (mean, sd), _ = intercepts
    out = res.refine(jax.random.key(1), clients, num_particles=N, islands=ISLANDS,
                     local_draws=2, gradient=True, progress_bar=False)
    assert out.reached and out.renewed >= 0.9
    _within_mc_error(out, mean, sd)


def test_bad_input_is_refused_before_anything_runs(linear, intercepts):
    res, clients, *_ = linear
    with pytest.raises(ValueError, match="num_particles must be at least 100"):
        fedppl.SMC(linear_model, res.guide, res.q, num_particles=50, islands=2)
    with pytest.raises(ValueError, match="islands"):
        fedppl.SMC(linear_model, res.guide, res.q, num_particles=1000, islands=7)
    with pytest.raises(ValueError, match="persistence must be in"):
        fedppl.SMC(linear_model, res.guide, res.q, persistence=1.0)
    with pytest.raises(ValueError, match="uniform_step must be in"):
        fedppl.SMC(linear_model, res.guide, res.q, uniform_step=-0.1)
    with pytest.raises(ValueError, match="crank_nicolson is a walk of its own"):
        fedppl.SMC(linear_model, res.guide, res.q, crank_nicolson=True, gradient=True)
    with pytest.raises(ValueError, match="islands"):
        fedppl.SMC(linear_model, res.guide, res.q, num_particles=200, islands=20)
    with pytest.raises(ValueError, match="local_draws must be even"):
        fedppl.SMC(linear_model, res.guide, res.q, local_draws=3)
    with pytest.raises(ValueError, match="pool_steps"):
        fedppl.SMC(linear_model, res.guide, res.q, pool_steps=-1)
    with pytest.raises(TypeError, match="start must be a Gaussian"):
        fedppl.SMC(linear_model, res.guide, {"mean": 0})
    with pytest.raises(TypeError, match="guide must be"):
        fedppl.SMC(linear_model, None, res.q)
    with pytest.raises(ValueError, match="method must be"):
        res.refine(jax.random.key(0), clients, method="nuts")
    private = dataclasses.replace(res, privacy={"worst_epsilon": 1.0, "delta": 1e-5})
    with pytest.raises(ValueError, match="differentially private"):
        private.refine(jax.random.key(0), clients, method="smc")
    # clients that are not the run's: other features, or another number of clients
    other = fedppl.partition.homogeneous(np.ones((40, 5)), np.ones(40), num_clients=2, seed=0)
    with pytest.raises(ValueError, match="not the run's clients"):
        res.refine(jax.random.key(0), other, method="smc")
    ires, iclients, _, _ = intercepts
    fewer = fedppl.Clients.from_list([iclients.client(k) for k in range(3)])
    with pytest.raises(ValueError, match="not the run's clients"):
        ires.refine(jax.random.key(0), fewer, method="smc", n_groups=2)
    # a result without a Gaussian q over a model's global sites
    with pytest.raises(TypeError, match="check and refine apply"):
        fedppl.infer.base.Result(history={"round": np.ones(1)}).refine(jax.random.key(0),
                                                                       clients)

    def subsampled(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with numpyro.plate("data", X.shape[0], subsample_size=5) as idx:
            numpyro.sample("y", dist.Normal(X[idx] @ w, 0.5), obs=y[idx])

    guide = fedppl.PVIGuide(subsampled, family="fullrank").setup(*clients.client(0))
    with pytest.raises(ValueError, match="subsamples plate"):
        fedppl.SMC(subsampled, guide, guide.prior).run(jax.random.key(0), clients,
                                                       progress_bar=False)
