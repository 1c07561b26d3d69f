"""A hierarchical model as users write it: groups numbered from 0 within each client, a plate
as large as the largest client's, the group effects local. What the run gives a group a client
holds no data for (the pooled posterior of a new group, against NUTS), an index past the plate,
the hint for a model whose group effects were left global, which sites a run treats as what,
and warnings a user can act on."""

from __future__ import annotations

import contextlib
import io
import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS

import fedppl
from fedppl.guides import PVIGuide

SIZES = (1, 2, 3, 6)  # groups each client holds, numbered from 0 at each client
GLOBAL = ["mu_a", "sigma_a", "b", "sigma_y"]


def intercepts(X, g, y=None, *, n_groups):
    """Random-intercept linear regression, the group scale learned."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 5.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(2.0))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    sigma_y = numpyro.sample("sigma_y", dist.HalfNormal(2.0))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(a[g] + X @ b, sigma_y), obs=y)


def logistic_intercepts(X, g, y=None, *, n_groups):
    """Random-intercept logistic regression, the group scale learned."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 2.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=a[g] + X @ b), obs=y)


def grouped(logistic: bool, seed: int = 0, rows: int = 12):
    """Per client ``(X, g, y)`` with g numbered from 0, and the pooled data numbered across
    clients."""
    rng = np.random.default_rng(seed)
    effects = 0.8 + 0.7 * rng.normal(size=sum(SIZES))
    parts, pooled, start = [], [], 0
    for s in SIZES:
        g = np.repeat(np.arange(s), rows * (3 if logistic else 1))
        X = rng.normal(size=(len(g), 2))
        f = effects[start + g] + X @ np.array([0.5, -0.3])
        y = ((rng.uniform(size=len(g)) < 1 / (1 + np.exp(-f))).astype(float) if logistic
             else f + 0.6 * rng.normal(size=len(g)))
        parts.append((X, g, y))
        pooled.append((X, g + start, y))
        start += s
    return parts, tuple(np.concatenate(a) for a in zip(*pooled, strict=True))


def new_group_by_nuts(model, pooled):
    """NUTS on the pooled data with one more group that has no data: its effect's posterior."""
    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=2500, progress_bar=False)
    mcmc.run(jax.random.key(3), *pooled, n_groups=sum(SIZES) + 1)
    draws = mcmc.get_samples()
    return np.asarray(draws["a"][:, -1]), np.asarray(draws["a"][:, :-1])


@pytest.fixture(scope="module", params=["gaussian", "logistic"])
def fitted(request):
    logistic = request.param == "logistic"
    model = logistic_intercepts if logistic else intercepts
    parts, pooled = grouped(logistic)
    glob = [n for n in GLOBAL if n != "sigma_y"] if logistic else GLOBAL
    guide = PVIGuide(model, global_sites=glob, family="fullrank")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the run's progress lines
        res = fedppl.PVI(model, guide).run(jax.random.key(0), fedppl.Clients(parts), 6,
                                           n_groups=max(SIZES))
    first = err.getvalue().strip().splitlines()[0]
    return model, first, pooled, res, new_group_by_nuts(model, pooled)


def test_groups_a_client_does_not_hold_get_the_pooled_posterior_of_a_new_group(fitted):
    """Client 0 holds group 0 of 6: its groups 1-5 are groups without data, and each of their
    draws is p(a_j | mu_a, sigma_a) at a draw of the global sites, which NUTS on the pooled data
    gives a group without data. Before: N(0, 1) whatever the model said."""
    _, _, _, res, (new, _) = fitted
    assert res.held is not None and res.held.sum(1).tolist() == list(SIZES)
    draws = np.asarray(res.sample(jax.random.key(1), 8000, client=0)["a"][:, 1:])
    assert abs(draws.mean() - new.mean()) < 0.1 * new.std()
    assert abs(draws.std() / new.std() - 1) < 0.1
    # each unheld group is drawn given the global sites (correlated with mu_a, as under NUTS)
    mu = np.asarray(res.sample(jax.random.key(1), 8000, client=0)["mu_a"])
    assert np.corrcoef(draws[:, 2], mu)[0, 1] > 0.1


def test_groups_with_data_are_unchanged(fitted):
    """The held groups' draws are the private guide's, draw for draw; the predictive of an
    unheld group is the new group's."""
    model, _, _, res, (new, _) = fitted
    k = 2
    local = jax.tree_util.tree_map(lambda x: x[k], res.local)
    raw = res.guide.sample(jax.random.key(4), res.q, 500, local)
    filled = res.sample(jax.random.key(4), 500, client=k)
    np.testing.assert_array_equal(filled["a"][:, :3], raw["a"][:, :3])
    assert not np.allclose(filled["a"][:, 3:], raw["a"][:, 3:])
    everyone = res.sample_clients(jax.random.key(4), 500)
    assert everyone["a"].shape == (500, len(SIZES), max(SIZES))
    # a record of client 2's group 4 (which it does not hold) at x = 0
    y = np.asarray(res.predictive(jax.random.key(5), np.zeros((1, 2)), np.array([4]),
                                  num_samples=4000, client=k)["y"][:, 0])
    if model is intercepts:
        sigma = np.asarray(res.sample(jax.random.key(5), 4000)["sigma_y"])
        spread = np.sqrt(new.var() + np.mean(sigma**2))
        assert abs(y.mean() - new.mean()) < 0.1 * spread
    else:
        p = np.mean(1 / (1 + np.exp(-new)))
        assert abs(y.mean() - p) < 4 * np.sqrt(p * (1 - p) / 4000) + 0.02


def test_an_index_past_the_plate_is_refused_naming_the_client_and_site():
    """n_groups=5 while client 3 numbers its groups 0-5: JAX would clamp group 5 onto group 4
    and fit a different model without a word."""
    parts, _ = grouped(False)
    guide = PVIGuide(intercepts, global_sites=GLOBAL, family="fullrank")
    with pytest.raises(ValueError, match=r"client 3: the model indexes an array out of range "
                                         r"\(the latent site 'a' in plate 'groups' of size 5\)"):
        fedppl.PVI(intercepts, guide).run(jax.random.key(0), fedppl.Clients(parts), 1,
                                          progress_bar=False, n_groups=5)
    with pytest.raises(ValueError, match="client 3: the model indexes an array out of range"):
        fedppl.EP(intercepts, PVIGuide(intercepts)).run(
            jax.random.key(0), fedppl.Clients(parts), 1, progress_bar=False, n_groups=5)


def test_an_index_check_of_a_model_that_reads_its_data_runs_op_by_op():
    """The index check runs the log density as one compiled program; a model that reads a
    group count from its data's values cannot be traced so, and is checked op by op: in range
    it passes, one short it is refused naming the plate."""
    from numpyro import handlers

    from fedppl import validation

    def counted(g, y=None, *, extra=1):
        n = int(np.max(np.asarray(g))) + extra  # the data's values, read while tracing
        with numpyro.plate("groups", n):
            a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", g.shape[0]):
            numpyro.sample("y", dist.Normal(a[g], 1.0), obs=y)

    g, y = np.array([0, 1, 2, 2]), np.zeros(4)

    def check(extra):
        tr = handlers.trace(handlers.seed(counted, 0)).get_trace(g, y, extra=extra)
        return validation.indices_in_range(counted, (g, y), {"extra": extra}, tr, "client 7")

    assert check(1) is None
    with pytest.raises(ValueError, match=r"client 7: the model indexes an array out of range "
                                         r"\(the latent site 'a' in plate 'groups' of size 2\)"):
        check(0)


def test_local_shapes_of_a_model_that_reads_its_data_are_found_op_by_op():
    """Each client's local-site shapes come from an abstract trace; a model that reads its
    group count from its data's values is run op by op instead, and a client whose count
    differs is still named."""

    def counted(g, y=None):
        n = int(np.max(np.asarray(g))) + 1  # the data's values, read while tracing
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("groups", n):
            a = numpyro.sample("a", dist.Normal(mu, 1.0))
        with numpyro.plate("data", g.shape[0]):
            numpyro.sample("y", dist.Normal(a[g], 1.0), obs=y)

    parts = [(np.array([0, 1, 1]), np.zeros(3)), (np.array([0, 1, 2]), np.zeros(3))]
    guide = PVIGuide(counted, global_sites=["mu"])
    with pytest.raises(ValueError, match=r"local site 'a' has shape \(3,\) for client 1 but "
                                         r"\(2,\) for client 0"):
        fedppl.PVI(counted, guide).run(jax.random.key(0), fedppl.Clients(parts), 1,
                                       progress_bar=False)


def test_group_effects_left_global_get_a_hint():
    """Without global_sites every site is global. Groups numbered from 0 within each client
    then share one element across clients (the model as written, not the one meant), and
    groups numbered across clients each enter one client: both say so, with the fix."""
    parts, _ = grouped(False, rows=4)
    pvi = fedppl.PVI(intercepts, PVIGuide(intercepts, family="fullrank"))
    with pytest.warns(UserWarning, match=r"'a' is shared unevenly: a\[0\] enters 4 clients' "
                                         r"likelihoods, a\[5\] 1.*global_sites=\['mu_a', "
                                         r"'sigma_a', 'b', 'sigma_y'\]") as seen:
        pvi.init(jax.random.key(0), fedppl.Clients(parts), n_groups=max(SIZES))
    assert seen[0].filename == __file__  # at the user's line
    across = [(X, g + sum(SIZES[:k]), y) for k, (X, g, y) in enumerate(parts)]
    with pytest.warns(UserWarning, match="each enter one client's likelihood only: making it "
                                         "local"):
        pvi.init(jax.random.key(0), fedppl.Clients(across), n_groups=sum(SIZES))
    with warnings.catch_warnings():  # local group effects: nothing to say
        warnings.simplefilter("error")
        fedppl.PVI(intercepts, PVIGuide(intercepts, global_sites=GLOBAL)).init(
            jax.random.key(0), fedppl.Clients(parts), n_groups=max(SIZES))


def test_a_run_says_which_sites_are_global_and_which_local(fitted):
    """In its summary and in the first line of its progress."""
    _, first, _, res, _ = fitted
    roles = res.summary()
    assert roles["local_sites"] == ["a"] and roles["global_sites"][:2] == ["mu_a", "sigma_a"]
    assert first.startswith("PVI (sequential): global sites mu_a, sigma_a, b [2]")
    assert first.endswith("local to each client: a [6]")


def test_nan_put_in_after_partitioning_names_the_client():
    parts, _ = grouped(False, rows=4)
    clients = fedppl.Clients(parts)
    clients.client(2)[0][3, 1] = np.nan
    for method in (fedppl.EP, fedppl.PVI):
        with pytest.raises(ValueError, match=r"client 2: array 0 has NaN or infinite values "
                                             r"\(rows \[3\]"):
            method(intercepts, PVIGuide(intercepts, global_sites=GLOBAL)).run(
                jax.random.key(0), clients, 1, progress_bar=False, n_groups=max(SIZES))
