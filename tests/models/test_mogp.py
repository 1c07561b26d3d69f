"""LMC multi-output GP: closed forms (SGPR/Titsias, Jaakkola-Jordan, Eq. 20), model, inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.infer.util import log_density

from fedppl.models import mogp

W = jnp.array([[0.6, 0.4], [0.4, 0.6], [-0.5, 0.9]])


def _problem(kinds, n=25, m=8, seed=0, kernel="rbf", hidden=()):
    spec = mogp.MOGPSpec(kinds, 2, kernel)
    rng = np.random.default_rng(seed)
    Xs = [rng.uniform(0, 10, (n, 2)) for _ in kinds]
    ys = [np.sin(x[:, 0]) + 0.3 * rng.normal(size=n) if k == "regression"
          else (rng.uniform(size=n) < 0.5).astype(float) for x, k in zip(Xs, kinds, strict=True)]
    hyper = mogp.init_hyper(spec, 2, jax.random.PRNGKey(seed), hidden=hidden, phi0=[1.0, 2.0],
                            phi1=[0.5, 0.2], W=W[: len(kinds)], noise=0.2)
    hyper = hyper._replace(log_noise=jnp.log(jnp.linspace(0.1, 0.3, len(kinds))))
    data = mogp.client_data(Xs, ys, spec, client=0)
    return spec, hyper, data, mogp.sample_inducing(jax.random.PRNGKey(seed + 1), data, m)


def _dense_lmc(spec, hyper, Z, data):
    """K_uu (block diagonal), K_uf and diag K_ff of the LMC model, in numpy."""
    phi0, phi1 = np.exp(hyper.log_phi0), np.exp(hyper.log_phi1)
    X, t, Wn = np.asarray(data.X), np.asarray(data.task), np.asarray(hyper.W)
    Z = np.asarray(Z)
    def rbf(A, B, a, b):
        return a * np.exp(-0.5 * b * ((A[:, None] - B[None]) ** 2).sum(-1))

    M, B = len(Z), spec.num_latent
    Kuu = np.zeros((B * M, B * M))
    Kuf = np.zeros((B * M, len(X)))
    kff = np.zeros(len(X))
    for b in range(B):
        Kuu[b * M:(b + 1) * M, b * M:(b + 1) * M] = rbf(Z, Z, phi0[b], phi1[b]) + \
            spec.jitter * phi0[b] * np.eye(M)
        Kuf[b * M:(b + 1) * M] = rbf(Z, X, phi0[b], phi1[b]) * Wn[t, b][None, :]
        kff += Wn[t, b] ** 2 * phi0[b]
    return Kuu, Kuf, kff


def test_regression_cavi_is_titsias_posterior_and_collapsed_bound():
    spec, hyper, data, Z = _problem(("regression", "regression"))
    q = mogp.cavi_qu(spec, hyper, Z, data, jnp.zeros(data.y.shape))
    Kuu, Kuf, kff = _dense_lmc(spec, hyper, Z, data)
    d = np.exp(np.asarray(hyper.log_noise))[np.asarray(data.task)]
    y = np.asarray(data.y)
    Sig = np.linalg.inv(Kuu + (Kuf / d) @ Kuf.T)
    np.testing.assert_allclose(q.mean, Kuu @ Sig @ Kuf @ (y / d), atol=1e-8)
    np.testing.assert_allclose(q.cov, Kuu @ Sig @ Kuu, atol=1e-8)
    Q = Kuf.T @ np.linalg.solve(Kuu, Kuf)
    C = Q + np.diag(d)
    _, logdet = np.linalg.slogdet(C)
    collapsed = (-0.5 * (y @ np.linalg.solve(C, y) + logdet + len(y) * np.log(2 * np.pi))
                 - 0.5 * np.sum((kff - np.diag(Q)) / d))
    assert abs(float(mogp.elbo(spec, hyper, Z, data, q, jnp.zeros(len(y)))) - collapsed) < 1e-8


def test_classification_term_equals_jaakkola_jordan():
    spec, hyper, data, Z = _problem(("regression", "classification"))
    q = mogp.cavi_qu(spec, hyper, Z, data, jnp.ones(data.y.shape))
    c = mogp.update_c(spec, hyper, Z, data, q)
    m, v = mogp.marginals(spec, hyper, Z, data.X, data.task, q)
    m, v, cc, y, t = (np.asarray(a) for a in (m, v, c, data.y, data.task))
    s2 = np.exp(np.asarray(hyper.log_noise))[t]
    reg = -0.5 * np.log(2 * np.pi * s2) - ((y - m) ** 2 + v) / (2 * s2)
    lam = np.tanh(cc / 2) / (4 * cc)  # Jaakkola-Jordan lambda(c)
    jj = (-np.logaddexp(0, -cc) + (y - 0.5) * m - cc / 2 - lam * (m**2 + v - cc**2))
    expected = np.where(t == 1, jj, reg).sum() - float(mogp.kl_qu(spec, hyper, Z, q))
    assert abs(float(mogp.elbo(spec, hyper, Z, data, q, c)) - expected) < 1e-8
    # any other q(omega) gives a lower bound
    assert float(mogp.elbo(spec, hyper, Z, data, q, c * 1.3)) < expected


def test_closed_form_noise_maximises_elbo():
    spec, hyper, data, Z = _problem(("regression", "classification"))
    c = jnp.ones(data.y.shape)
    q = mogp.cavi_qu(spec, hyper, Z, data, c)
    sums, counts = mogp.noise_stats(spec, hyper, Z, data, q)
    assert np.all(np.asarray(counts) == [25, 0])
    best = jnp.where(counts > 0, jnp.log(sums / jnp.maximum(counts, 1)), hyper.log_noise)
    def f(ln):
        return mogp.elbo(spec, hyper._replace(log_noise=ln), Z, data, q, c)

    g = jax.grad(f)(best)
    assert np.max(np.abs(np.asarray(g))) < 1e-8
    for delta in (-0.05, 0.05):
        for t in (0,):
            assert float(f(best.at[t].add(delta))) < float(f(best))


@pytest.mark.parametrize("kernel", mogp.KERNELS)
def test_kernels_are_psd_with_diag_phi0(kernel):
    X = jax.random.normal(jax.random.PRNGKey(0), (12, 3))
    K = mogp.kernel(kernel, X, X, 2.0, 0.3)
    assert np.allclose(np.diag(K), 2.0)
    assert np.linalg.eigvalsh(np.asarray(K)).min() > -1e-10
    d1, d2 = float(jnp.sum(jnp.abs(X[0] - X[1]))), float(jnp.sum((X[0] - X[1]) ** 2))
    closed = {"rbf": 2.0 * np.exp(-0.15 * d2), "laplace": 2.0 * np.exp(-0.15 * d1),
              "cauchy": 2.0 / (0.3 * d2 + 1.0),
              "linear": 2.0 * float(X[0] @ X[1]) / float(jnp.linalg.norm(X[0]) *
                                                         jnp.linalg.norm(X[1]))}
    assert np.isclose(K[0, 1], closed[kernel], rtol=1e-10)


def test_numpyro_model_log_density_matches_manual():
    spec, hyper, data, Z = _problem(("regression", "classification"), n=6, m=4, hidden=(4, 3))
    us = [jnp.linspace(-1, 1, 4) * (b + 1) for b in range(2)]
    Phi, cond, _, _ = mogp.projections(spec, hyper, Z, data.X, data.task)
    f = Phi @ jnp.concatenate(us) + jnp.linspace(-0.5, 0.5, data.y.shape[0]) * jnp.sqrt(cond)
    params = {"u_0": us[0], "u_1": us[1], "f": f}
    lp, _ = log_density(mogp.mogp_model, (data.X, data.task, spec, hyper, Z),
                        {"y": data.y}, params)
    from scipy.stats import multivariate_normal, norm
    K, _ = mogp.kzz_chol(spec, hyper, mogp.features(hyper, Z))
    ref = sum(multivariate_normal(np.zeros(4), np.asarray(K[b])).logpdf(us[b]) for b in range(2))
    ref += norm(np.asarray(Phi @ jnp.concatenate(us)), np.sqrt(np.asarray(cond) + 1e-12)
                ).logpdf(np.asarray(f)).sum()
    y, t, fn = np.asarray(data.y), np.asarray(data.task), np.asarray(f)
    sd = np.exp(0.5 * np.asarray(hyper.log_noise))[t]
    ref += np.where(t == 0, norm(fn, sd).logpdf(y), y * fn - np.logaddexp(0, fn)).sum()
    assert abs(float(lp) - ref) < 1e-8 * max(1.0, abs(ref))


def test_bad_inputs_name_client_and_task():
    spec = mogp.MOGPSpec(("regression", "classification"))
    X = np.zeros((3, 1))
    with pytest.raises(ValueError, match=r"client 7, task 1.*\{0, 1\}"):
        mogp.client_data([X, X], [np.zeros(3), np.array([0.0, 1.0, -1.0])], spec, client=7)
    Xn = X.copy()
    Xn[1, 0] = np.nan
    with pytest.raises(ValueError, match="client 3, task 0: inputs contain NaN"):
        mogp.client_data([Xn, X], [np.zeros(3), np.zeros(3)], spec, client=3)
    with pytest.raises(ValueError, match="client 2: no data"):
        mogp.client_data([None, np.zeros((0, 1))], [None, np.zeros(0)], spec, client=2)


def test_missing_task_contributes_nothing():
    spec, hyper, data, Z = _problem(("regression", "classification"))
    only_reg = mogp.client_data([np.asarray(data.X[:25]), None], [np.asarray(data.y[:25]), None],
                                spec, client=0)
    assert np.all(np.asarray(only_reg.task) == 0)
    # padded as fedppl.Clients pads a client: zero rows, masked out
    padded = mogp.multitask_clients([([np.asarray(data.X[:25]), None],
                                      [np.asarray(data.y[:25]), None])], spec)
    X, y, t = (jnp.pad(a[0], [(0, 15)] + [(0, 0)] * (a.ndim - 2)) for a in padded.stacked)
    padded = mogp.Data(X, y, t, jnp.arange(40) < 25)
    q = mogp.cavi_qu(spec, hyper, Z, only_reg, jnp.ones(25))
    qp = mogp.cavi_qu(spec, hyper, Z, padded, jnp.ones(40))
    np.testing.assert_allclose(q.mean, qp.mean, atol=1e-10)
    e = mogp.elbo(spec, hyper, Z, only_reg, q, jnp.ones(25))
    assert abs(float(e) - float(mogp.elbo(spec, hyper, Z, padded, qp, jnp.ones(40)))) < 1e-9


# -- one network per latent GP (theta_b of Eq. 1c) -------------------------------------------------


def _rbf(A, B, a, b):
    return a * np.exp(-0.5 * b * ((np.asarray(A)[:, None] - np.asarray(B)[None]) ** 2).sum(-1))


def test_every_latent_has_its_own_network_by_default():
    spec, hyper, data, Z = _problem(("regression", "classification"), n=10, m=5, hidden=(4, 3))
    assert isinstance(hyper.net, tuple) and len(hyper.net) == 2
    w0, w1 = (np.asarray(n.layers[0].weight) for n in hyper.net)
    assert not np.allclose(w0, w1)                       # drawn from their own keys
    H = mogp.features(hyper, Z)
    assert H.shape == (2, 5, 3)
    # K_b(Z, Z) is latent b's base kernel on latent b's own features
    K, _ = mogp.kzz_chol(spec, hyper, H)
    phi0, phi1 = np.exp(hyper.log_phi0), np.exp(hyper.log_phi1)
    for b in range(2):
        ref = _rbf(hyper.net[b](Z), hyper.net[b](Z), phi0[b], phi1[b])
        ref += spec.jitter * phi0[b] * np.eye(5)
        assert np.allclose(K[b], ref, rtol=1e-10, atol=1e-12)
    # and K_b(Z, X) enters the projections: E[f_n | u] with u = e_j of latent b
    Phi, _, _, _ = mogp.projections(spec, hyper, Z, data.X, data.task)
    X = data.X
    for b in range(2):
        A = np.linalg.solve(K[b], _rbf(hyper.net[b](Z), hyper.net[b](X), phi0[b], phi1[b]))
        want = np.asarray(hyper.W)[np.asarray(data.task), b][:, None] * A.T
        assert np.allclose(Phi[:, b * 5:(b + 1) * 5], want, rtol=1e-8, atol=1e-10)


def test_shared_network_is_per_latent_networks_that_are_equal():
    spec, shared, data, Z = _problem(("regression", "classification"), n=10, m=5, hidden=(4,))
    shared = shared._replace(net=mogp.init_hyper(spec, 2, jax.random.PRNGKey(7), hidden=(4,),
                                                 per_latent=False).net)
    assert not isinstance(shared.net, tuple)
    twins = shared._replace(net=(shared.net, shared.net))
    c = jnp.full(data.y.shape, 0.7)
    q1, q2 = (mogp.cavi_qu(spec, h, Z, data, c) for h in (shared, twins))
    assert np.allclose(q1.mean, q2.mean, atol=1e-12) and np.allclose(q1.cov, q2.cov, atol=1e-12)
    e1, e2 = (mogp.elbo(spec, h, Z, data, q1, c) for h in (shared, twins))
    assert abs(float(e1) - float(e2)) < 1e-10
    # a shared network's gradient is the sum of the twins' gradients
    g1 = jax.grad(lambda h: mogp.elbo(spec, h, Z, data, q1, c))(shared)
    g2 = jax.grad(lambda h: mogp.elbo(spec, h, Z, data, q1, c))(twins)
    total = jax.tree_util.tree_map(lambda a, b: a + b, *g2.net)
    for a, b in zip(jax.tree_util.tree_leaves(g1.net), jax.tree_util.tree_leaves(total),
                    strict=True):
        assert np.allclose(a, b, rtol=1e-8, atol=1e-12)


def test_per_latent_networks_in_float32():
    kinds = ("regression", "classification")
    spec, hyper, data, Z = _problem(kinds, n=12, m=6, hidden=(4, 3))
    c = jnp.full(data.y.shape, 0.5)
    q64 = mogp.cavi_qu(spec, hyper, Z, data, c)
    e64 = float(mogp.elbo(spec, hyper, Z, data, q64, c))
    with jax.enable_x64(False):
        h32 = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), hyper)
        d32 = data._replace(X=jnp.asarray(data.X, jnp.float32), y=jnp.asarray(data.y, jnp.float32))
        Z32, c32 = jnp.asarray(Z, jnp.float32), jnp.asarray(c, jnp.float32)
        q32 = mogp.cavi_qu(spec, h32, Z32, d32, c32)
        e32 = mogp.elbo(spec, h32, Z32, d32, q32, c32)
        assert q32.mean.dtype == jnp.float32 and e32.dtype == jnp.float32
    assert np.allclose(q32.mean, q64.mean, atol=1e-3)
    assert abs(float(e32) - e64) < 1e-3 * max(1.0, abs(e64))
