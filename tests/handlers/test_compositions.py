"""Every fedppl handler composed with numpyro's handlers, in both nestings.

Each fedppl handler comes with a small model, the values of its latent sites and a reference: the
log density, site by site, that the handler promises (computed here by hand, not by the handler).
For each numpyro handler and each nesting the test checks what that numpyro handler promises on
top of it: ``seed`` draws from the rewritten distributions, ``trace`` records the rewritten sites,
``substitute`` and ``condition`` values are used (a conditioned site is observed, and the fedppl
handler treats it as observed), ``block`` hides its site, ``scale`` multiplies and ``mask`` zeroes
every site's log density.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers as nh
from scipy import stats

from fedppl.families import gaussian as g
from fedppl.handlers import cavity, client, polya_gamma, tempered
from fedppl.sites import SiteLayout

RNG = np.random.default_rng(0)
X = RNG.normal(size=(6, 2))
REAL = np.arange(6) < 4  # client: the last two rows are padding
Y_REG = np.where(REAL, X @ np.array([1.0, -0.5]) + 0.3 * RNG.normal(size=6), 50.0)
Y_BIN = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
OMEGA = RNG.uniform(0.05, 0.25, 6)


class Spec(NamedTuple):
    model: Callable
    wrap: Callable  # model -> fedppl handler applied to it
    obs: dict  # the model's observed data, passed as keyword arguments (None when conditioned)
    values: dict  # latent values
    ref: Callable  # (values, conditioned names, names hidden from the handler) -> {site: log p}
    cond: dict  # what `condition` observes
    hide: str  # the site `block` hides
    draws: dict  # site -> (mean, sd) of one coordinate's draws under `seed`, where not the prior's


# -- cavity: the prior at the global sites w, b is the cavity (chain rule over the sites seen) ----


def reg_model(y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", 6):
        numpyro.sample("y", dist.Normal(X @ w + b, 1.0), obs=y)


LAYOUT = SiteLayout.from_model(reg_model, y=Y_REG)
A = RNG.normal(size=(3, 3))
CAV_MEAN, CAV_COV = np.array([3.0, -3.0, 2.0]), 0.3 * (A @ A.T + np.eye(3))
FULL = g.FullGaussian.from_moments(CAV_MEAN, CAV_COV)
DIAG = g.DiagGaussian.from_moments(CAV_MEAN, np.diag(CAV_COV))


def cavity_ref(q, values, cond=(), hidden=()):
    """Gaussian conditionals by covariance algebra: each site given the earlier sites it sees."""
    mean, cov = (np.asarray(a) for a in g.to_moments(q))
    cov = np.diag(cov) if cov.ndim == 1 else cov
    idx = {"w": [0, 1], "b": [2]}
    theta = np.concatenate([np.atleast_1d(values["w"]), np.atleast_1d(values["b"])])
    out, seen = {}, []
    for name in ("w", "b"):
        i = idx[name]
        if name in hidden:
            continue
        m, c = mean[i], cov[np.ix_(i, i)]
        if seen:
            gain = cov[np.ix_(i, seen)] @ np.linalg.inv(cov[np.ix_(seen, seen)])
            m = m + gain @ (theta[seen] - mean[seen])
            c = c - gain @ cov[np.ix_(seen, i)]
        out[name] = stats.multivariate_normal(m, c).logpdf(theta[i])
        seen += i
    f = X @ values["w"] + values["b"]
    out["y"] = stats.norm(f, 1.0).logpdf(Y_REG).sum()
    return out


def cavity_spec(q):
    return Spec(reg_model, lambda m: cavity(m, q, LAYOUT), {"y": Y_REG},
                {"w": np.array([2.5, -2.0]), "b": np.array(1.5)},
                lambda v, cond=(), hidden=(): cavity_ref(q, v, cond, hidden),
                {"w": np.array([2.0, -3.5])}, "w",
                {"w": (CAV_MEAN[0], np.sqrt(CAV_COV[0, 0])),
                 "b": (CAV_MEAN[2], np.sqrt(CAV_COV[2, 2]))})


# -- client: padded rows of observed sites in the data plate do not count ------------------------


def lin_model(y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", 6):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def client_ref(values, cond=(), hidden=()):
    w = values["w"]
    return {"w": stats.norm(0, 1).logpdf(w).sum(),
            "y": stats.norm(X[REAL] @ w, 0.5).logpdf(Y_REG[REAL]).sum()}


# -- tempered: the named latent sites' log densities times alpha; conditioned ones are observed --

ALPHA = 0.1


def temp_model(y=None):
    z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    phi = numpyro.sample("phi", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", 3):
        numpyro.sample("y", dist.Normal(z + phi, 1.0), obs=y)


def tempered_ref(values, cond=(), hidden=()):
    z, phi = values["z"], values["phi"]
    return {"z": (1.0 if "z" in cond else ALPHA) * stats.norm(0, 1).logpdf(z),
            "phi": ALPHA * stats.norm(0, 2).logpdf(phi),
            "y": stats.norm(z + phi, 1.0).logpdf(Y_REG[:3]).sum()}


# -- polya_gamma: an observed Bernoulli-logit site becomes -log 2 + kappa f - omega f^2 / 2 ------


def logit_model(y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", 6):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def pg_ref(values, cond=(), hidden=()):
    w = values["w"]
    f = X @ w
    return {"w": stats.norm(0, 1).logpdf(w).sum(),
            "y": np.sum(-np.log(2.0) + (Y_BIN - 0.5) * f - 0.5 * OMEGA * f**2)}


SPECS = {
    "cavity_fullrank": cavity_spec(FULL),
    "cavity_meanfield": cavity_spec(DIAG),
    "client": Spec(lin_model, lambda m: client(m, mask=jnp.asarray(REAL)), {"y": Y_REG},
                   {"w": np.array([0.8, -0.3])}, client_ref, {"y": Y_REG}, "w", {}),
    "tempered": Spec(temp_model, lambda m: tempered(m, alpha=ALPHA, sites=["z", "phi"]),
                     {"y": Y_REG[:3]}, {"z": np.array(0.4), "phi": np.array(-1.2)},
                     tempered_ref, {"z": np.array(0.7)}, "z", {}),
    "polya_gamma": Spec(logit_model, lambda m: polya_gamma(m, omega=OMEGA), {"y": Y_BIN},
                        {"w": np.array([0.5, -1.5])}, pg_ref, {"y": Y_BIN}, "w", {}),
}
NUMPYRO = ["seed", "trace", "substitute", "condition", "block", "scale", "mask"]
SCALE = 3.0


def site_log_probs(tr) -> dict:
    """Each sample site's log density as numpyro's ``log_density`` counts it."""
    out = {}
    for name, site in tr.items():
        if site["type"] == "sample":
            lp = jnp.sum(site["fn"].log_prob(site["value"]))
            out[name] = float(lp if site["scale"] is None else site["scale"] * lp)
    return out


def compose(spec, numpyro_handler, outside, model):
    """``numpyro_handler(fedppl(model))`` if ``outside``, else the other nesting."""
    if outside:
        return numpyro_handler(spec.wrap(model))
    return spec.wrap(numpyro_handler(model))


def run(spec, numpyro_handler, outside, base, obs):
    """Trace ``base`` under both handlers (seeded, outermost trace) and return the trace."""
    return nh.trace(nh.seed(compose(spec, numpyro_handler, outside, base), 0)).get_trace(**obs)


def assert_log_probs(got: dict, expected: dict):
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-9, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("outside", [True, False], ids=["numpyro(fedppl)", "fedppl(numpyro)"])
@pytest.mark.parametrize("kind", NUMPYRO)
@pytest.mark.parametrize("name", list(SPECS))
def test_composition(name, kind, outside):
    spec = SPECS[name]
    fixed = nh.substitute(spec.model, data=spec.values)
    ref = spec.ref(spec.values)
    if kind == "seed":
        def draw(key, out):
            m = compose(spec, lambda f: nh.seed(f, key), out, spec.model)
            tr = nh.trace(m).get_trace(**spec.obs)
            return {n: s["value"] for n, s in tr.items() if s["type"] == "sample"}, tr

        values, tr = draw(jax.random.key(1), outside)
        other, _ = draw(jax.random.key(1), not outside)  # one key, one draw, in either nesting
        for n in values:
            np.testing.assert_allclose(values[n], other[n], err_msg=n)
        assert_log_probs(site_log_probs(tr), spec.ref(values))
        keys = jax.random.split(jax.random.key(2), 400)
        many = jax.jit(jax.vmap(lambda k: draw(k, outside)[0]))(keys) if spec.draws else {}
        for n, (mean, sd) in spec.draws.items():
            got = np.reshape(many[n], (400, -1))[:, 0]
            assert abs(got.mean() - mean) < 5 * sd / np.sqrt(400), (n, got.mean(), mean)
            assert abs(got.std() - sd) < 0.2 * sd, (n, got.std(), sd)
    elif kind == "trace":
        if outside:
            tr = run(spec, nh.trace, True, fixed, spec.obs)
        else:
            inner = nh.trace(fixed)
            nh.seed(spec.wrap(inner), 0)(**spec.obs)
            tr = inner.trace
        assert_log_probs(site_log_probs(tr), ref)
    elif kind == "substitute":
        tr = run(spec, lambda f: nh.substitute(f, data=spec.values), outside, spec.model, spec.obs)
        for n, v in spec.values.items():
            np.testing.assert_allclose(tr[n]["value"], v)
        assert_log_probs(site_log_probs(tr), ref)
    elif kind == "condition":
        rest = {n: v for n, v in spec.values.items() if n not in spec.cond}
        obs = {n: (None if n in spec.cond else v) for n, v in spec.obs.items()}
        tr = run(spec, lambda f: nh.condition(f, data=spec.cond), outside,
                 nh.substitute(spec.model, data=rest), obs)
        for n, v in spec.cond.items():
            assert tr[n]["is_observed"]
            np.testing.assert_allclose(tr[n]["value"], v)
        assert_log_probs(site_log_probs(tr), spec.ref({**rest, **spec.cond}, cond=set(spec.cond)))
    elif kind == "block":
        tr = run(spec, lambda f: nh.block(f, hide=[spec.hide]), outside, fixed, spec.obs)
        assert spec.hide not in tr
        expected = spec.ref(spec.values, hidden=() if outside else (spec.hide,))
        expected.pop(spec.hide, None)
        assert_log_probs(site_log_probs(tr), expected)
    elif kind == "scale":
        tr = run(spec, lambda f: nh.scale(f, SCALE), outside, fixed, spec.obs)
        assert_log_probs(site_log_probs(tr), {n: SCALE * v for n, v in ref.items()})
    elif kind == "mask":
        tr = run(spec, lambda f: nh.mask(f, mask=False), outside, fixed, spec.obs)
        assert_log_probs(site_log_probs(tr), dict.fromkeys(ref, 0.0))
        kept = site_log_probs(run(spec, lambda f: nh.mask(f, mask=True), outside, fixed, spec.obs))
        assert_log_probs(kept, ref)


def test_full_rank_cavity_under_condition_is_the_conditional_cavity():
    """The latent site b sees the cavity's conditional given the conditioned w, in both
    nestings."""
    w = jnp.array([2.0, -3.5])
    mean, cov = CAV_MEAN, CAV_COV
    gain = cov[2:, :2] @ np.linalg.inv(cov[:2, :2])
    for m in (nh.condition(cavity(reg_model, FULL, LAYOUT), {"w": w}),
              cavity(nh.condition(reg_model, {"w": w}), FULL, LAYOUT)):
        fn = nh.trace(nh.seed(m, 0)).get_trace(y=Y_REG)["b"]["fn"]
        base = getattr(fn, "base_dist", fn)
        np.testing.assert_allclose(base.loc, mean[2:] + gain @ (w - mean[:2]), rtol=1e-10)
        np.testing.assert_allclose(base.covariance_matrix, cov[2:, 2:] - gain @ cov[:2, 2:],
                                   rtol=1e-10)


def test_cavity_sites_sampled_out_of_layout_order_add_up_to_the_joint():
    def swapped(y=None):
        b = numpyro.sample("b", dist.Normal(0.0, 2.0))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("data", 6):
            numpyro.sample("y", dist.Normal(X @ w + b, 1.0), obs=y)

    values = {"w": jnp.array([2.5, -2.0]), "b": jnp.array(1.5)}
    lp, _ = numpyro.infer.util.log_density(cavity(swapped, FULL, LAYOUT), (), {"y": Y_REG}, values)
    expected = sum(cavity_ref(FULL, values).values())
    np.testing.assert_allclose(lp, expected, rtol=1e-10)


def test_polya_gamma_names_a_site_observed_where_it_cannot_see():
    class observe(numpyro.primitives.Messenger):  # a handler that is not numpyro's condition
        def process_message(self, msg):
            if msg["name"] == "y":
                msg["value"], msg["is_observed"] = jnp.asarray(Y_BIN), True

    m = observe(polya_gamma(nh.substitute(logit_model, data={"w": jnp.zeros(2)})))
    with pytest.raises(ValueError, match="site 'y' was observed by a handler enclosing"):
        nh.trace(nh.seed(m, 0)).get_trace()


def test_a_site_blocked_before_condition_stays_latent():
    """``condition`` outside a ``block`` that hides y never observes y: polya_gamma keeps it."""
    inner = nh.trace(nh.substitute(logit_model, data={"w": jnp.zeros(2)}))
    m = nh.condition(nh.block(polya_gamma(inner), hide=["y"]), {"y": jnp.asarray(Y_BIN)})
    nh.seed(m, 0)()
    assert not inner.trace["y"]["is_observed"]
    assert isinstance(inner.trace["y"]["fn"], dist.BernoulliLogits)
    shown = nh.condition(polya_gamma(inner), {"y": jnp.asarray(Y_BIN)})
    nh.seed(shown, 0)()
    assert "polya_gamma" in inner.trace["y"]["infer"]
