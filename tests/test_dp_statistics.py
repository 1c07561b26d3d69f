"""Private sufficient statistics (fedppl.algorithms.dp_statistics) and their use in FedBNR and
FSGP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import norm

import fedppl
from fedppl.algorithms import dp_statistics as dps
from fedppl.algorithms import exact, fsgp
from fedppl.algorithms import fedbnr as bnr
from fedppl.algorithms.dp_statistics import PrivateStatistics
from fedppl.models.random_features import URKSpec

NO_CLIP = dict(feature_bound=1e6, target_bound=1e6)


@pytest.fixture(scope="module")
def regression():
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (1500, 1))
    y = np.sin(X[:, 0]) + 0.1 * rng.normal(size=1500)
    return X, y, fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)


# -- the mechanism -------------------------------------------------------------------------------


def test_sensitivity_is_attained_by_an_axis_aligned_record():
    Bx, By = 0.7, 1.5
    rng = np.random.default_rng(1)
    Phi = rng.normal(size=(30, 3))
    y = rng.normal(size=30)
    extreme = (np.array([[Bx, 0.0, 0.0]]), np.array([By]))
    both = dps.released(exact.client_stats(jnp.vstack([Phi, extreme[0]]),
                                           jnp.concatenate([y, extreme[1]])))
    one = dps.released(exact.client_stats(jnp.asarray(Phi), jnp.asarray(y)))
    assert float(jnp.linalg.norm(both - one)) == pytest.approx(dps.sensitivity(Bx, By),
                                                                rel=1e-12)
    # any clipped record moves the release by at most Delta
    mech = dps.Mechanism(Bx, By, 0.0)
    rows = dps.clip_rows(jnp.asarray(rng.normal(size=(200, 3)) * 3), Bx)
    ys = dps.clip_targets(jnp.asarray(rng.normal(size=200) * 3), By)
    moves = jax.vmap(lambda r, t: jnp.linalg.norm(dps.released(exact.client_stats(
        r[None], t[None]))))(rows, ys)
    assert float(moves.max()) <= dps.sensitivity(Bx, By) * (1 + 1e-12)
    assert mech.noise_std == 0.0


def test_noise_is_symmetric_and_has_the_stated_scale():
    stats = exact.client_stats(jnp.eye(3), jnp.ones(3))
    keys = jax.random.split(jax.random.key(0), 4000)
    out = jax.vmap(lambda k: dps.add_noise(stats, 2.0, k))(keys)
    assert bool(jnp.all(out.scatter == jnp.swapaxes(out.scatter, 1, 2)))
    noise = dps.released(out) - dps.released(stats)
    np.testing.assert_allclose(np.std(noise, axis=0), 2.0, rtol=0.08)


def _gaussian_delta(eps, mu):
    """The tight delta(eps) of a Gaussian mechanism with sensitivity/std ratio mu."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def _privacy_losses(R, mu, mu_prime, std):
    """log N(R; mu, std^2 I) - log N(R; mu', std^2 I) for each row of R."""
    return (np.sum((R - mu_prime) ** 2, 1) - np.sum((R - mu) ** 2, 1)) / (2 * std**2)


_release = jax.jit(jax.vmap(jax.vmap(lambda P, y, mech, k: dps.released(dps.private_stats(
    P, y, None, mech, k)), (None, None, None, 0)), (None, None, None, 0)))


def _hockey_stick(releases, eps, shrink, n=20_000, seed=0):
    """For neighbouring data (one record at the sensitivity bound removed), the Monte Carlo
    estimate of delta(eps) = E_P[(1 - exp(eps - L))_+] in both directions, its standard error, the
    fraction of draws with L > eps, and the exact values for the mechanism as accounted."""
    Bx, By, delta = 1.0, 2.0, 1e-2
    spec = PrivateStatistics(epsilon=eps, delta=delta, feature_bound=Bx, target_bound=By)
    sigma = spec.noise_multiplier_for(releases)
    assert spec.spent(sigma, releases) <= eps
    mech = spec.mechanism(sigma / shrink)
    rng = np.random.default_rng(seed)
    Phi = jnp.asarray(rng.normal(size=(20, 3)))
    y = jnp.asarray(rng.normal(size=20))
    big = (jnp.vstack([Phi, jnp.array([[Bx, 0.0, 0.0]])]), jnp.concatenate([y, jnp.array([By])]))
    out = []
    for here, there in ((big, (Phi, y)), ((Phi, y), big)):
        keys = jax.random.split(jax.random.key(seed), (n, releases))
        R = np.asarray(_release(*here, mech, keys)).reshape(n, -1)
        mu = np.tile(np.asarray(dps.released(exact.client_stats(*map(_clip(mech), here)))),
                     releases)
        mu2 = np.tile(np.asarray(dps.released(exact.client_stats(*map(_clip(mech), there)))),
                      releases)
        L = _privacy_losses(R, mu, mu2, mech.noise_std)
        terms = np.maximum(0.0, 1.0 - np.exp(eps - L))
        out.append((terms.mean(), terms.std() / math.sqrt(n), np.mean(eps < L)))
    ratio = math.sqrt(releases) * shrink / sigma  # ||mu - mu'|| / std over all releases
    return out, _gaussian_delta(eps, ratio), norm.sf(eps / ratio - ratio / 2), delta


def _clip(mech):
    def clip(a):
        return dps.clip_rows(a, mech.feature_bound) if a.ndim == 2 else dps.clip_targets(
            a, mech.target_bound)
    return clip


@pytest.mark.parametrize("releases", [1, 2])
def test_empirical_privacy_loss_meets_the_accounted_epsilon(releases):
    """The mechanism is exactly the Gaussian the accountant composes: the Monte Carlo
    hockey-stick divergence (the exact (eps, delta)-DP condition) is at most delta, and matches
    the analytic value; so does the tail P[L > eps]."""
    eps = 1.0
    directions, exact_delta, exact_tail, delta = _hockey_stick(releases, eps, shrink=1.0)
    assert exact_delta <= delta
    for est, se, tail in directions:
        assert est <= delta + 4 * se
        assert abs(est - exact_delta) <= 4 * se
        assert abs(tail - exact_tail) <= 4 * math.sqrt(exact_tail * (1 - exact_tail) / 20_000)


def test_empirical_check_fails_when_noise_is_cut_tenfold():
    directions, _, _, delta = _hockey_stick(1, 1.0, shrink=10.0)
    for est, se, _ in directions:
        assert est > delta + 4 * se + 4 * math.sqrt(delta * (1 - delta) / 20_000)


def test_repair_projects_onto_the_psd_cone_and_counts():
    S = jnp.diag(jnp.array([2.0, 1.0, -0.5]))
    fixed, n = dps.repair_scatter(S)
    np.testing.assert_allclose(fixed, jnp.diag(jnp.array([2.0, 1.0, 0.0])), atol=1e-14)
    assert int(n) == 1
    clean = jnp.array([[2.0, 1.0], [1.0, 2.0]])
    same, n0 = dps.repair_scatter(clean)
    assert int(n0) == 0 and bool(jnp.all(same == clean))


def test_first_order_noise_covariance_matches_monte_carlo_at_small_noise():
    """Var(phi*^T m~) over noise draws equals phi*^T Cov_noise(m) phi* (the docstring's
    formula, E's diagonal and off-diagonal terms included) when the noise is small."""
    rng = np.random.default_rng(2)
    Phi = jnp.asarray(rng.normal(size=(50, 3)))
    stats = exact.client_stats(Phi, Phi @ jnp.array([1.0, -2.0, 0.5]))
    Xs = jnp.asarray(rng.normal(size=(4, 3)))
    s, tau = 0.5, 0.05

    @jax.jit
    @jax.vmap
    def mean(key):
        return dps.predict(dps.add_noise(stats, tau, key), Xs, s, 1.0)[0]

    draws = np.asarray(mean(jax.random.split(jax.random.key(0), 20_000)))
    post = exact.posterior(stats, s, 1.0)
    chol = jnp.linalg.cholesky(post.prec)
    m = jnp.linalg.solve(post.prec, post.nat1)
    want = dps.mean_noise_variance(chol, m, Xs, tau**2, s**2)
    np.testing.assert_allclose(draws.var(axis=0), want, rtol=0.05)


def test_noise_aware_predictive_is_calibrated_where_the_naive_one_is_not():
    """Bayesian linear regression over 4 clients at epsilon = 1: over 2,000 noise draws the 90%
    intervals of f(x*) from the naive posterior cover the truth about a fifth of the time, those
    with the first-order noise term about 90%."""
    rng = np.random.default_rng(0)
    D, N, K, s = 4, 4000, 4, 0.3
    Phi = rng.normal(size=(N, D))
    Phi /= np.linalg.norm(Phi, axis=1).max()
    w = rng.normal(size=D)
    y = Phi @ w + s * rng.normal(size=N)
    Xs = rng.normal(size=(30, D))
    Xs /= np.linalg.norm(Xs, axis=1, keepdims=True)
    spec = PrivateStatistics(epsilon=1.0, delta=1e-5, feature_bound=1.0,
                             target_bound=float(np.abs(y).max()))
    mech = spec.mechanism(spec.noise_multiplier_for(1))
    parts = (jnp.asarray(Phi.reshape(K, N // K, D)), jnp.asarray(y.reshape(K, N // K)))

    @jax.jit
    @jax.vmap
    def draw(key):
        msgs = jax.vmap(lambda P, t, k: dps.private_stats(P, t, None, mech, k))(
            *parts, jax.random.split(key, K))
        total = exact.Stats(*(x.sum(0) for x in msgs))
        total = total._replace(scatter=dps.repair_scatter(total.scatter)[0])
        m, aware = dps.predict(total, Xs, s, 1.0, K * mech.noise_std**2)
        return m, dps.predict(total, Xs, s, 1.0)[1] - s**2, aware - s**2

    m, naive, aware = (np.asarray(a) for a in draw(jax.random.split(jax.random.key(0), 2000)))
    err = np.abs(m - Xs @ w)
    cover_naive = np.mean(err <= 1.645 * np.sqrt(naive))
    cover_aware = np.mean(err <= 1.645 * np.sqrt(aware))
    assert cover_naive < 0.5
    assert 0.85 <= cover_aware <= 0.96
    assert abs(cover_aware - 0.9) < abs(cover_naive - 0.9)


def test_noise_aware_factor_is_the_plug_in_one_without_noise():
    rng = np.random.default_rng(4)
    Phi = jnp.asarray(rng.normal(size=(40, 5)))
    stats = exact.client_stats(Phi, Phi @ jnp.asarray(rng.normal(size=5)))
    nat1, prec = dps.noise_aware_factor(stats.scatter, stats.proj, 0.3**2, 0.0)
    np.testing.assert_allclose(prec, stats.scatter / 0.3**2, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(nat1, stats.proj / 0.3**2, rtol=1e-10)
    aware = dps.noise_aware_posterior(stats, 0.3, 1.0, 2.0)  # the plug-in precision back
    np.testing.assert_allclose(dps.plug_in_precision(aware.prec, 1.0, 0.3**2, 2.0),
                               exact.posterior(stats, 0.3, 1.0).prec, rtol=1e-8)


def test_noise_aware_posterior_falls_back_to_the_prior_where_noise_swamps_the_sums():
    """Small data at epsilon = 1 (the regression test above with 200 points and 10 inputs): the
    plug-in posterior's mean divides the projection's noise by s^2 along the directions the
    repaired scatter lost (test RMSE of f in the hundreds, measured 172); the noise-aware one
    stays near the prior (measured 0.8, the truth's sd 1) and as good as the plug-in one where
    the data dominate (D = 4, N = 4,000: 0.154 against 0.158)."""
    def rmse(D, N):
        rng = np.random.default_rng(0)
        Phi = rng.normal(size=(N, D))
        Phi /= np.linalg.norm(Phi, axis=1).max()
        w = rng.normal(size=D)
        y = Phi @ w + 0.3 * rng.normal(size=N)
        Xs = rng.normal(size=(30, D))
        Xs /= np.linalg.norm(Xs, axis=1, keepdims=True)
        spec = PrivateStatistics(epsilon=1.0, delta=1e-5, feature_bound=1.0,
                                 target_bound=float(np.abs(y).max()))
        mech = spec.mechanism(spec.noise_multiplier_for(1))
        tau2 = 4 * mech.noise_std**2
        parts = (jnp.asarray(Phi.reshape(4, N // 4, D)), jnp.asarray(y.reshape(4, N // 4)))

        @jax.jit
        @jax.vmap
        def draw(key):
            msgs = jax.vmap(lambda P, t, k: dps.private_stats(P, t, None, mech, k))(
                *parts, jax.random.split(key, 4))
            total = exact.Stats(*(x.sum(0) for x in msgs))
            total = total._replace(scatter=dps.repair_scatter(total.scatter)[0])
            post = dps.noise_aware_posterior(total, 0.3, 1.0, tau2)
            mean = dps.predict_noise_aware(post, Xs, 0.3, 1.0, tau2)[0]
            return mean, dps.predict(total, Xs, 0.3, 1.0)[0]

        aware, plug = (np.asarray(a) for a in draw(jax.random.split(jax.random.key(0), 300)))
        f = Xs @ w
        return np.sqrt(np.mean((aware - f) ** 2)), np.sqrt(np.mean((plug - f) ** 2))

    aware, plug = rmse(10, 400)
    assert aware < 1.5 and plug > 20, (aware, plug)
    aware, plug = rmse(4, 4000)
    assert aware < 1.1 * plug, (aware, plug)


def test_private_fsgp_and_fedbnr_on_the_guides_examples_stay_near_the_data():
    """docs/guide/fsgp.md and fedbnr.md at epsilon 1 and 2: the private predictive means were
    in the hundreds (plug-in posteriors); now within the targets' range."""
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (100, 1))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=100)
    clients = fedppl.partition.homogeneous(X, y, num_clients=3, seed=0)
    fsgp_run = fedppl.FSGP(num_inducing=8, local_steps=50, init_inducing="random-normal",
                           privacy=PrivateStatistics(feature_bound=1.0, target_bound=2.0,
                                                     epsilon=1.0, delta=1e-5))
    res = fsgp_run.run(jax.random.key(0), clients, 3, progress_bar=False)
    spec = URKSpec(input_dim=1, feature_widths=(), shift_widths=(), num_samples=20)
    bnr_run = fedppl.FedBNR(spec, local_steps=10, eval_every=5,
                            privacy=PrivateStatistics(feature_bound=1.0, target_bound=2.0,
                                                      epsilon=2.0, delta=1e-5))
    res_bnr = bnr_run.run(jax.random.key(0), clients, 5, progress_bar=False)
    for mean in (res.predict(X)[0], res_bnr.predict(X)[0]):
        assert np.max(np.abs(np.asarray(mean))) < 2.0


# -- FedBNR --------------------------------------------------------------------------------------

SPEC = URKSpec(input_dim=1, feature_widths=(), shift_widths=(), num_samples=5)


def _exact_layers(result, clients):
    stats = jax.vmap(lambda X, y, m: jax.vmap(lambda p: bnr.client_stats(
        p.kernel, result.omega, X, y, m))(result.kernels))(*clients.stacked, clients.mask)
    return bnr.last_layers(stats, result.kernels, True)


def test_fedbnr_without_noise_equals_the_exact_last_layer(regression):
    X, _, clients = regression
    method = fedppl.FedBNR(SPEC, local_steps=1, eval_every=1,
                           privacy=PrivateStatistics(noise_multiplier=0.0, **NO_CLIP))
    result = method.run(jax.random.key(0), clients, 2, progress_bar=False)
    want = _exact_layers(result, clients)
    for a, b in zip(jax.tree_util.tree_leaves(result.layers), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
    plain = bnr.predict(result.kernels, want.global_, result.omega, jnp.asarray(X[:5]))
    for a, b in zip(result.predict(X[:5]), plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    p = result.privacy
    assert p["releases"].tolist() == [2, 2, 2] and np.isinf(p["worst_epsilon"])
    assert result.history["repaired"].tolist() == [0, 0]


def test_fedbnr_at_large_epsilon_is_close_and_accounts_each_evaluation(regression):
    X, _, clients = regression
    spec = PrivateStatistics(epsilon=5000.0, delta=1e-5, feature_bound=1.0, target_bound=3.0)
    method = fedppl.FedBNR(SPEC, local_steps=1, eval_every=1, privacy=spec)
    result = method.run(jax.random.key(0), clients, 2, progress_bar=False)
    p = result.privacy
    sigma = p["noise_multiplier"]
    np.testing.assert_allclose(result.history["epsilon"],
                               [spec.spent(sigma, 1), spec.spent(sigma, 2)])
    assert p["epsilon"].tolist() == [p["worst_epsilon"]] * 3
    assert p["worst_epsilon"] == result.history["epsilon"][-1] <= 5000.0
    assert p["stat_noise_var"]["global"] == pytest.approx(3 * p["noise_std"] ** 2)
    assert result.summary()["epsilon"] == p["worst_epsilon"]
    # the predictive mean (the weights are ill-determined along the features' null directions)
    want = _exact_layers(result, clients).global_
    ref = bnr.predict(result.kernels, want, result.omega, jnp.asarray(X))[0]
    mean, aware = result.predict(X)
    assert float(jnp.sqrt(jnp.mean((mean - ref) ** 2))) <= 0.05 * float(
        jnp.sqrt(jnp.mean(ref**2)))
    assert bool(jnp.all(aware > result.predict(X, noise_aware=False)[1]))


def test_fedbnr_statistics_leave_the_client_noised_with_its_own_key(regression):
    _, _, clients = regression
    mech = PrivateStatistics(noise_multiplier=1.0, feature_bound=1.0, target_bound=3.0
                             ).mechanism(1.0)
    settings = bnr.Settings("avg", fedppl.FedBNR(SPEC).optimizer, privacy=mech)
    trio = bnr.make_trio(settings)
    from fedppl.models.random_features import base_draws, init_urk
    params = bnr.init_params(init_urk(jax.random.key(1), SPEC))
    omega = base_draws(jax.random.key(2), SPEC)
    kernels = jax.tree_util.tree_map(lambda x: x[None], params)
    states = bnr.init_clients(params, 3, private=True)
    keys = jax.vmap(jax.random.key_data)(jax.random.split(jax.random.key(3), 3))
    states = states._replace(noise_key=keys)
    sent = jax.vmap(trio.client_evaluate, (None, 0, 0, 0))((kernels, omega), states,
                                                           clients.stacked, clients.mask)
    clean = jax.vmap(lambda X, y, m: bnr.client_stats(params.kernel, omega, X, y, m))(
        *clients.stacked, clients.mask)
    noise = np.asarray(sent.proj[:, 0] - clean.proj)
    assert np.all(np.abs(noise) > 0) and not np.allclose(noise[0], noise[1])
    with pytest.raises(ValueError, match="noise keys"):
        trio.client_evaluate((kernels, omega), bnr.ClientState(params), tuple(
            a[0] for a in clients.stacked), clients.mask[0])


# -- FSGP ----------------------------------------------------------------------------------------


def test_fsgp_without_noise_equals_the_exact_aggregate(regression):
    X, _, clients = regression
    method = fedppl.FSGP(num_inducing=5, local_steps=2,
                         privacy=PrivateStatistics(noise_multiplier=0.0, **NO_CLIP))
    result = method.run(jax.random.key(0), clients, 1, progress_bar=False)
    parts = [fsgp.client_stats(result.params, *map(jnp.asarray, clients.client(k)))
             for k in range(clients.num_clients)]
    total = exact.Stats(*(sum(p[i] for p in parts) for i in range(3)))
    want = fsgp.predict(result.params, total, jnp.asarray(X[:5]), result.jitter)
    for a, b in zip(result.predict(X[:5]), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    assert result.privacy["releases"].tolist() == [1, 1, 1] and result.privacy["repaired"] == 0
    assert result.to_json()["summary"]["epsilon"] is None  # inf: no noise


def test_fsgp_server_accepts_noised_statistics_and_repairs_their_sum():
    X = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4, 1)
    y = jnp.sin(X[..., 0])
    params = fsgp.init_params(X[0, :3])
    mech = PrivateStatistics(noise_multiplier=2.0, feature_bound=1.0, target_bound=1.0
                             ).mechanism(2.0)
    keys = jax.random.split(jax.random.key(0), 3)
    stats = jax.jit(jax.vmap(lambda a, b, k: fsgp.private_client_stats(
        params, a, b, None, mech, k)))(X, y, keys)
    msgs = fsgp.Message(jax.tree_util.tree_map(lambda x: jnp.zeros((3, *x.shape)), params),
                        stats)
    state = fsgp.init(params)._replace(phase=jnp.asarray(fsgp.AGGREGATE))
    everyone = jnp.ones(3, bool)
    server = jax.jit(fsgp.server_update, static_argnums=3)
    strict = server(state, msgs, everyone, False)[1]
    assert not bool(strict.all())  # noised A_k are not PSD: the exact server refuses them
    new, ok = server(state, msgs, everyone, True)
    assert bool(ok.all()) and int(new.repaired) > 0
    assert float(jnp.linalg.eigvalsh(new.stats.scatter)[0]) >= -1e-10
    predict = jax.jit(fsgp.predict)
    aware = predict(new.params, new.stats, X[0], stat_noise_var=3 * mech.noise_std**2)[1]
    naive = predict(new.params, new.stats, X[0])[1]
    assert bool(jnp.all(aware > naive))


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(epsilon=0.0), "epsilon must be positive"),
    (dict(epsilon=-1.0), "epsilon must be positive"),
    (dict(epsilon=1.0, noise_multiplier=1.0), "exactly one of epsilon"),
    (dict(), "exactly one of epsilon"),
    (dict(noise_multiplier=-0.5), "noise_multiplier must be"),
    (dict(epsilon=1.0, delta=0.0), "delta must be in"),
    (dict(epsilon=1.0, delta=1.0), "delta must be in"),
    (dict(epsilon=1.0, delta=1.5), "delta must be in"),
    (dict(epsilon=1.0, feature_bound=0.0), "feature_bound must be"),
    (dict(epsilon=1.0, feature_bound=float("nan")), "feature_bound must be"),
    (dict(epsilon=1.0, target_bound=-1.0), "target_bound must be"),
    (dict(epsilon=1.0, accounting="moments"), "accounting must be"),
])
def test_bad_settings_are_refused(kwargs, match):
    settings = dict(feature_bound=1.0, target_bound=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        PrivateStatistics(**settings)


def test_bad_uses_are_refused_before_any_client_runs(regression):
    _, _, clients = regression
    with pytest.raises(TypeError, match="PrivateStatistics"):
        fedppl.FedBNR(SPEC, privacy={"epsilon": 1.0})
    with pytest.raises(TypeError, match="PrivateStatistics"):
        fedppl.FSGP(privacy=1.0)
    spec = PrivateStatistics(epsilon=1.0, feature_bound=1.0, target_bound=1.0)
    with pytest.raises(ValueError, match="pass num_rounds"):
        fedppl.FedBNR(SPEC, privacy=spec).init(jax.random.key(0), clients)
    hopeless = PrivateStatistics(epsilon=1e-4, feature_bound=1.0, target_bound=1.0)
    with pytest.raises(ValueError, match="no noise multiplier"):
        fedppl.FSGP(num_inducing=5, privacy=hopeless).init(jax.random.key(0), clients)
