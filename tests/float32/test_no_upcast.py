"""No silent float64: float32 in, float32 out, with x64 *on* (the suite's mode; see
``conftest.py``). Under x64 a float64 constant (``np.eye``, ``jnp.zeros(n)`` with no dtype, a NumPy
statistic, ``numpyro``'s ``Normal(X @ w, 0.5)``, whose Python-float scale it turns into a float64
NumPy array) promotes a float32 computation to float64; with x64 off it cannot, so these checks
only mean something here. PVI runs in float32 in an x64 process when its guide asks for it:
``PVIGuide(model, dtype=jnp.float32)``; the floating data are cast to that dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers

from fedppl.algorithms import conjugate
from fedppl.algorithms import natural_gradient as ng
from fedppl.families import gaussian as g
from fedppl.families import lognormal
from fedppl.families import polya_gamma as pg
from fedppl.guides import PVIGuide
from fedppl.handlers import cavity, client
from fedppl.sites import prior_correction, prior_factor
from tests.conftest import linear_model, logistic_model
from tests.float32.conftest import F32, assert_dtype, rtol


@pytest.fixture(autouse=True)
def x64_on():
    assert jax.config.jax_enable_x64, "these checks need x64 on (tests/conftest.py sets it)"


def hierarchical(X, y=None):
    """Priors that are not Gaussian in the unconstrained space: a NumPy-fitted Gaussian base and
    a prior correction (HalfCauchy, and a scale that is another latent site)."""
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, tau).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def random_effects(X, g_idx, y=None, n_groups=3):
    """A local site per group (the client's private guide) and a float64-prone Normal scale."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + u[g_idx], 0.5), obs=y)


def _algebra(fq: g.FullGaussian, dq: g.DiagGaussian, x, key) -> dict:
    """Every function of the Gaussian algebra (and the LogNormal and Polya-Gamma helpers) once."""
    outs = {}
    for q in (fq, dq):
        name = type(q).__name__
        other = g.scale(q, 0.5)
        outs.update({f"{name} {what}": out for what, out in {
            "product": g.product(q, q), "quotient": g.quotient(q, other),
            "damp": g.damp(q, other, 0.3), "scale": other, "zeros_like": g.zeros_like(q),
            "strong": g.strong(q), "to_moments": g.to_moments(q),
            "mean_and_scale_tril": g.mean_and_scale_tril(q), "kl": g.kl(q, other),
            "log_prob": g.log_prob(q, x), "sample": g.sample(key, q, 4),
            "repair": g.repair(g.quotient(q, g.scale(q, 2.0))),
            "to_distribution": g.to_distribution(q).log_prob(x), "to_full": g.to_full(q),
            "embed": g.embed(q, 2), "head": g.head(g.embed(q, 2), 3),
            "project_moments": g.project_moments(q, True),
            "kl_from_moments": g.kl_from_moments(*g.mean_and_scale_tril(q), other,
                                                 g.to_moments(other)[0]),
        }.items()})
    mean, cov = g.to_moments(fq)
    cnd = g.Conditional(jnp.ones(2, F32), 2 * jnp.eye(2, dtype=F32), jnp.full((2, 3), 0.1, F32))
    joint = g.join(fq, cnd, False)
    c = jnp.linspace(0.0, 3.0, 5, dtype=F32)
    outs.update({
        "FullGaussian.from_moments": g.FullGaussian.from_moments(mean, cov),
        "DiagGaussian.from_moments": g.DiagGaussian.from_moments(mean, jnp.diagonal(cov)),
        "project_diag": g.project_diag(fq), "join": joint, "split": g.split(joint, 3),
        "join diag": g.join(dq, g.Conditional(jnp.ones(2, F32), jnp.eye(2, dtype=F32),
                                              jnp.zeros((2, 3), F32)), True),
        "split diag": g.split(g.embed(dq, 2), 3),
        "conditional_entropy": g.conditional_entropy(cnd),
        "lognormal": lognormal.to_params(lognormal.from_params(jnp.zeros(2, F32),
                                                               jnp.ones(2, F32))),
        "pg.mean": pg.mean(1.0, c), "pg.kl_to_prior": pg.kl_to_prior(1.0, c),
        "pg.augmented_bound": pg.augmented_bound(jnp.ones(5, F32), c, c),
    })
    return outs


def test_gaussian_algebra_keeps_float32():
    rng = np.random.default_rng(8)
    a = rng.normal(size=(3, 3))
    prec = jnp.asarray(a @ a.T + 3 * np.eye(3), F32)
    fq = g.FullGaussian(prec @ jnp.asarray(rng.normal(size=3), F32), prec)
    dq = g.DiagGaussian(jnp.diagonal(fq.prec) * 0.5, jnp.diagonal(fq.prec))
    x = jnp.asarray(rng.normal(size=3), F32)
    # traced once (the promotion rules are the same as op by op, at one compilation's cost)
    outs = jax.jit(_algebra)(fq, dq, x, jax.random.key(0))
    for what, out in outs.items():
        assert_dtype(out, what=what)
    # and one op by op, the way the rest of the package also calls them
    assert_dtype(g.kl(fq, g.scale(fq, 0.5)), what="eager kl")
    assert_dtype(g.repair(g.scale(fq, -1.0)), what="eager repair")


@pytest.mark.parametrize("family", ["fullrank", "meanfield"])
def test_guide_layout_and_priors_keep_float32(data32, family):
    X, _, y = data32
    guide = PVIGuide(hierarchical, family=family, dtype=jnp.float32).setup(X, y)
    assert guide.layout.dtype == F32
    assert_dtype(guide.prior, what="prior")
    assert_dtype([s.base for s in guide.layout.sites if s.base is not None], what="bases")
    assert_dtype(prior_factor(guide.layout, family), what="prior_factor")
    correction = prior_correction(hierarchical, guide.layout, family, (X, y), {})
    theta = jnp.full(guide.layout.dim, 0.1, F32)
    assert_dtype(jax.jit(correction)(theta), what="prior_correction")
    params = guide.params_from(guide.prior)
    assert_dtype(params, what="params_from")
    assert_dtype(guide.q_from(params), what="q_from")
    assert_dtype(guide.mean_and_tril(params), what="mean_and_tril")
    assert_dtype(guide.sample(jax.random.key(0), guide.prior, 5), what="sample")
    # without dtype the guide follows JAX's default float: float64 here, as before
    assert PVIGuide(logistic_model, family=family).setup(X, y).prior.nat1.dtype == jnp.float64


def test_local_sites_keep_float32(data32):
    X, y, _ = data32
    idx = np.arange(len(y)) % 3
    guide = PVIGuide(random_effects, local_sites=["u"], family="fullrank",
                     dtype=jnp.float32).setup(X, idx, y)
    local = guide.init_local()
    assert_dtype(local, what="init_local")
    data, mask = (X, idx, y), jnp.ones(len(y), bool)
    log_lik = ng.log_lik_fn(random_effects, guide, data, mask)
    joint = g.join(guide.prior, local, False)
    cavity_joint = g.embed(guide.prior, local.nat1.shape[-1])
    eps = ng.base_draws(8, joint.dim, F32)
    # one natural-gradient step over (theta, z), and the client's joint split back
    step = jax.jit(lambda q: ng.target(log_lik, cavity_joint, q, eps))(joint)
    assert_dtype(step, what="target over (theta, z)")
    assert_dtype(g.split(step, guide.layout.dim), what="split")
    solver = ng.NaturalGradientSolver(random_effects, guide, num_draws=8)
    assert_dtype(jax.jit(lambda q, c: solver.expected_log_lik(q, data, mask, c))(
        guide.prior, local), what="expected_log_lik with local sites")


def test_conjugate_likelihood_keeps_float32(data32):
    X, y, _ = data32
    guide = PVIGuide(linear_model, family="fullrank", dtype=jnp.float32).setup(X, y)
    model = client(linear_model, mask=jnp.arange(len(y)) < 50)
    assert conjugate.check(model, guide.layout, X, y) is None
    lik = conjugate.likelihood_terms(model, guide.layout, X, y)
    assert_dtype(lik, what="likelihood_terms")
    factor = conjugate.likelihood_factor(lik)
    assert_dtype(factor, what="likelihood_factor")
    mean, cov = g.to_moments(g.product(guide.prior, factor))
    assert_dtype(conjugate.expected_log_lik(lik, mean, cov), what="expected_log_lik")
    # and it is X'X / sigma^2 over the unmasked rows, to float32 accuracy
    X64 = X[:50].astype(np.float64)
    want = X64.T @ X64 / 0.25
    np.testing.assert_allclose(factor.prec, want, rtol=rtol(), atol=rtol() * np.abs(want).max())


def test_natural_gradient_step_keeps_float32(data32):
    X, _, y = data32
    # float64 data: cast to the guide's dtype, and the step stays in float32 (the whole solve,
    # under PVI's compiled rounds, is in test_no_upcast_pvi.py)
    guide = PVIGuide(logistic_model, family="fullrank", dtype=jnp.float32).setup(X, y)
    mask = jnp.ones(len(y), bool)
    data = (X.astype(np.float64), y.astype(np.float64))
    log_lik = ng.log_lik_fn(logistic_model, guide, data, mask)
    eps = ng.base_draws(8, guide.layout.dim, F32)
    assert_dtype(eps, what="base_draws")

    @jax.jit
    def pieces(q):
        return {"target": ng.target(log_lik, g.scale(q, 0.5), q, eps),
                "expected_log_lik": ng.expected_log_lik(log_lik, q, eps),
                "round_off": ng.round_off(q)}

    for what, out in pieces(guide.prior).items():
        assert_dtype(out, what=what)
    # numpyro makes the 0.5 of Normal(X @ w, 0.5) a float64 NumPy array: the log density is
    # float64 inside and comes back in the guide's dtype
    lin = PVIGuide(linear_model, family="meanfield", dtype=jnp.float32).setup(X, y)
    log_lik = ng.log_lik_fn(linear_model, lin, (X, y), mask)
    assert_dtype(log_lik(jnp.zeros(3, F32)), what="log_lik of Normal(X @ w, 0.5)")


def test_handlers_keep_float32(data32):
    X, y, y_bin = data32
    guide = PVIGuide(linear_model, family="fullrank", dtype=jnp.float32).setup(X, y)
    q_cav = g.scale(guide.prior, 2.0)
    values = guide.layout.constrain(jnp.asarray([0.1, -0.2, 0.3], F32))
    tr = handlers.trace(handlers.substitute(
        handlers.seed(cavity(linear_model, q_cav, guide.layout), 0), data=values)).get_trace(X, y)
    assert_dtype(tr["w"]["fn"].log_prob(tr["w"]["value"]), what="cavity site log density")
    tr = handlers.trace(handlers.substitute(
        handlers.seed(client(logistic_model, mask=jnp.arange(len(y)) < 40), 0),
        data={"w": values["w"], "b": jnp.asarray(0.3, F32)})).get_trace(X, y_bin)
    assert_dtype(tr["y"]["fn"].log_prob(tr["y"]["value"]), what="client site log density")


def test_client_num_data_scale_keeps_float32(data32):
    X, _, y = data32
    tr = handlers.trace(handlers.substitute(
        handlers.seed(client(logistic_model, mask=jnp.arange(len(y)) < 40, num_data=400), 0),
        data={"w": jnp.zeros(3, F32), "b": jnp.asarray(0.0, F32)})).get_trace(X, y)
    log_density = jnp.sum(tr["y"]["fn"].log_prob(tr["y"]["value"]))
    assert_dtype(log_density, what="log density")  # float32 before the scale
    assert_dtype(tr["y"]["scale"] * log_density, what="scaled log density")
