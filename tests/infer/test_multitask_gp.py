"""The pFed-Mul front: init / update / run, history, ArviZ, JSON, predictions, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedppl
from fedppl.infer.multitask_gp import PFedMul, task_clients
from fedppl.models import mogp

SPEC = mogp.MOGPSpec(("regression", "classification"), 2)
HYPER = mogp.init_hyper(SPEC, 1, phi0=[1.0, 0.5], phi1=[0.5, 2.0],
                        W=jnp.array([[0.8, 0.3], [0.6, -0.4]]), noise=0.1)
COMMON = ("round", "seconds", "messages_up", "messages_down", "bytes_up", "bytes_down",
          "rejected")


def _tasks(seed, n_reg, n_cls):
    rng = np.random.default_rng(seed)
    xr, xc = rng.uniform(0, 10, (n_reg, 1)), rng.uniform(0, 10, (n_cls, 1))
    yc = (rng.uniform(size=n_cls) < 1 / (1 + np.exp(-2 * np.sin(xc[:, 0])))).astype(float)
    return [xr, xc], [np.sin(xr[:, 0]) + 0.2 * rng.normal(size=n_reg), yc]


CLIENTS = mogp.multitask_clients([_tasks(0, 12, 10), _tasks(1, 8, 14), _tasks(2, 10, 10)],
                                 SPEC, names=("a", "b", "c"))


@pytest.fixture(scope="module")
def result():
    return PFedMul(SPEC, HYPER, num_inducing=6).run(jax.random.PRNGKey(0), CLIENTS, 2,
                                                     progress_bar=False)


def test_history_json_and_summary(result):
    h = result.history
    assert set(COMMON) | {"elbo", "client_elbo", "exact_elbo"} <= set(h)
    assert h["round"].tolist() == [1, 2] and h["messages_up"].tolist() == [3, 3]
    assert h["client_elbo"].shape == (2, 3) and np.all(np.isfinite(h["exact_elbo"]))
    assert h["elbo"][1] > h["elbo"][0] and h["rejected"].tolist() == [0, 0]
    # a message: ELBO, gradient (10 hyperparameters), noise statistics (2 + 2), row count
    assert h["bytes_up"][0] == 3 * 8 * (1 + 10 + 4 + 1) and h["bytes_down"][0] == 3 * 8 * 10
    out = result.to_json()
    assert out["method"] == "PFedMul" and set(out["history"]) == set(h)
    assert out["summary"]["rounds"] == 2 and np.isfinite(out["summary"]["exact_elbo"])


def test_predict_and_arviz(result):
    X = np.linspace(0, 10, 7)[:, None]
    mean, var = result.predict(X, task=0)
    assert mean.shape == (3, 7) and np.all(np.asarray(var) > 0)
    m_b, _ = result.predict(X, task=0, client="b")
    np.testing.assert_array_equal(m_b, mean[1])
    p = np.asarray(result.predict_proba(X, task=1, client=2))
    assert p.shape == (7,) and np.all((p > 0) & (p < 1))
    idata = result.to_arviz(jax.random.PRNGKey(1), num_samples=20)
    assert idata.posterior["u_0"].shape == (4, 5, 3, 6)  # 4 chains of 5 draws
    assert list(idata.posterior["u_1"].coords["client"].values) == ["a", "b", "c"]
    f = idata.predictions["f_mean"].values[0, 0]
    assert f.shape == (3, 22) and np.isnan(f[2, 20:]).all() and np.isfinite(f[0]).all()
    assert idata.constant_data["client_W"].shape == (3, 2, 2)


def test_init_update_and_sampled_clients_keep_their_state():
    method = PFedMul(SPEC, HYPER, num_inducing=6, fraction=0.5,
                     optimizer=optax.sgd(1e-2), server_optimizer=optax.sgd(1e-3))
    state = method.init(jax.random.PRNGKey(2), CLIENTS)
    assert state.round == 0 and state.clients.Z.shape == (3, 6, 1)
    new, info = method.update(state)
    active = np.isfinite(info["client_elbo"])
    assert info["round"] == 1 and info["messages_up"] == active.sum() == 2
    for old, now in zip(jax.tree_util.tree_leaves(state.clients),
                        jax.tree_util.tree_leaves(new.clients), strict=True):
        assert np.array_equal(np.asarray(old)[~active], np.asarray(now)[~active])


def test_every_client_gets_as_many_inducing_inputs_as_the_smallest_has_rows():
    small = mogp.multitask_clients([_tasks(0, 2, 2), _tasks(1, 8, 6)], SPEC)
    with pytest.warns(UserWarning, match="client 0 has only 4 rows: every client uses 4"):
        state = PFedMul(SPEC, HYPER, num_inducing=6).init(jax.random.PRNGKey(0), small)
    assert state.clients.Z.shape == (2, 4, 1) and state.clients.q.cov.shape == (2, 8, 8)


def test_loop_schedule_gives_the_synchronous_numbers(result):
    loop = PFedMul(SPEC, HYPER, num_inducing=6, schedule="loop").run(
        jax.random.PRNGKey(0), CLIENTS, 2, progress_bar=False)
    np.testing.assert_allclose(loop.history["elbo"], result.history["elbo"], rtol=1e-10)
    np.testing.assert_allclose(loop.clients.q.mean, result.clients.q.mean, rtol=1e-8,
                               atol=1e-10)


def test_single_task_runs_on_task_clients():
    spec1 = SPEC._replace(kinds=("classification",), num_latent=1)
    hyper1 = mogp.init_hyper(spec1, 1, phi0=1.0, phi1=0.5, W=jnp.ones((1, 1)))
    st = PFedMul(SPEC, HYPER, num_inducing=4).single_task(1, hyper1)
    assert st.spec == spec1 and "W" in st.config.fixed
    res = st.run(jax.random.PRNGKey(0), task_clients(CLIENTS, 1), 1, progress_bar=False)
    assert np.isfinite(res.history["elbo"][0])
    no_cls = mogp.multitask_clients([([np.ones((3, 1)), None], [np.zeros(3), None])], SPEC)
    with pytest.raises(ValueError, match="client 0 has no rows of task 1"):
        task_clients(no_cls, 1)


# -- bad input: a clear error before anything is compiled ------------------------------------------

BAD_SETTINGS = [
    (dict(spec="rc"), TypeError, "spec must be"),
    (dict(spec=mogp.MOGPSpec(("regression", "ordinal"))), ValueError, "spec.kinds"),
    (dict(spec=mogp.MOGPSpec(("regression",), num_latent=0)), ValueError, "spec.num_latent"),
    (dict(hyper={"W": 1}), TypeError, "hyper must be"),
    (dict(hyper=HYPER._replace(W=jnp.ones((3, 2)))), ValueError, r"hyper.W must have shape"),
    (dict(hyper=HYPER._replace(log_noise=jnp.array([jnp.nan, 0.0]))), ValueError, "NaN"),
    (dict(hyper=HYPER._replace(net=())), TypeError, "hyper.net must be"),
    (dict(hyper=HYPER._replace(net=(HYPER.net[0],) * 3)), ValueError, "one per latent GP"),
    (dict(method="cavi"), ValueError, "method must be one of"),
    (dict(variant="everything"), ValueError, "variant must be one of"),
    (dict(fixed="W"), ValueError, "fixed must be"),
    (dict(fixed=("bias",)), ValueError, "fixed must be"),
    (dict(schedule="sequential"), ValueError, "schedule"),
    (dict(fraction=0.0), ValueError, "fraction must be positive"),
    (dict(fraction=1.5), ValueError, r"fraction must be in \(0, 1\]"),
    (dict(fraction=-0.2), ValueError, "fraction must be positive"),
    (dict(fraction=float("nan")), ValueError, "fraction must be positive and finite"),
    (dict(fraction="half"), TypeError, "fraction must be a number"),
    (dict(fraction=True), TypeError, "fraction must be a number"),
    (dict(num_inducing=0), ValueError, "num_inducing must be a positive integer"),
    (dict(num_inducing=2.5), TypeError, "num_inducing must be a positive integer"),
    (dict(cavi_iters=0), ValueError, "cavi_iters"),
    (dict(local_steps=-1), ValueError, "local_steps must be an integer >= 0"),
    (dict(vi_steps=0), ValueError, "vi_steps"),
    (dict(vi_samples=0), ValueError, "vi_samples"),
    (dict(optimizer="adam"), TypeError, "optimizer must be an optax optimiser"),
    (dict(server_optimizer=0.01), TypeError, "server_optimizer must be"),
    (dict(vi_optimizer="sgd"), TypeError, "vi_optimizer must be"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_SETTINGS)
def test_bad_settings(kwargs, error, match):
    args = {"spec": SPEC, "hyper": HYPER, **kwargs}
    with pytest.raises(error, match=match):
        PFedMul(args.pop("spec"), args.pop("hyper"), **args)


def _with(index, value):
    X0, y0, t0 = (np.array(a, dtype=float) for a in CLIENTS.data[0])
    arrays = [X0, y0, t0]
    arrays[index] = value(arrays[index])
    return fedppl.Clients.from_list([tuple(arrays)])


BAD_DATA = [
    ([tuple(a) for a in CLIENTS.data], TypeError, "clients must be a fedppl.Clients"),
    (fedppl.Clients.from_list([CLIENTS.data[0][:2]]), ValueError,
     r"expected arrays \(X, y, task\)"),
    (_with(0, lambda X: X[:, 0]), ValueError, r"client 0: X must have shape \(N, D\)"),
    (_with(2, lambda t: np.where(t == 1, 2, t)), ValueError,
     r"client 0: task labels must be in \(0, 1\); found \[2"),
    (_with(2, lambda t: t - 1), ValueError, r"task labels .* found \[-1"),
    (_with(2, lambda t: t + 0.5), ValueError, "task labels must be in"),
    (_with(1, lambda y: np.where(np.arange(len(y)) == 20, 2.0, y)), ValueError,
     r"classification labels must be in \(0, 1\); found \[2.0\]"),
    (_with(1, lambda y: y[:, None]), ValueError, "y and task must be 1-D"),
]


@pytest.mark.parametrize("clients,error,match", BAD_DATA)
def test_bad_clients(clients, error, match):
    with pytest.raises(error, match=match):
        PFedMul(SPEC, HYPER).init(jax.random.PRNGKey(0), clients)


def test_bad_data_caught_by_the_builders():
    X = np.ones((4, 1))
    with pytest.raises(ValueError, match="client 0, task 0: inputs contain NaN"):
        mogp.multitask_clients([([np.full((4, 1), np.nan), X], [np.zeros(4), np.ones(4)])], SPEC)
    with pytest.raises(ValueError, match="client 0: no data in any task"):
        mogp.multitask_clients([([None, None], [None, None])], SPEC)
    with pytest.raises(ValueError, match="there are no clients"):
        mogp.multitask_clients([], SPEC)
    with pytest.raises(TypeError, match="client 0: array 1 has dtype <U32"):
        _with(1, lambda y: y.astype(str))


def test_network_input_size_is_checked():
    hyper = mogp.init_hyper(SPEC, 3, jax.random.PRNGKey(0), hidden=(4,))
    with pytest.raises(ValueError, match="a: X has 1 features where 3 are expected"):
        PFedMul(SPEC, hyper).init(jax.random.PRNGKey(0), CLIENTS)


@pytest.mark.parametrize("rounds,error", [(0, ValueError), (-2, ValueError), (2.5, TypeError),
                                          ("3", TypeError)])
def test_bad_rounds(rounds, error):
    with pytest.raises(error, match="num_rounds must be a positive integer"):
        PFedMul(SPEC, HYPER).run(jax.random.PRNGKey(0), CLIENTS, rounds)


@pytest.mark.parametrize("key", [0, None])
def test_bad_key(key):
    with pytest.raises(TypeError, match="rng_key must be a JAX key"):
        PFedMul(SPEC, HYPER).run(key, CLIENTS, 1)


@pytest.mark.parametrize("call,error,match", [
    (lambda r: r.predict(np.ones(3), 0), ValueError, r"X must have shape \(N, D\)"),
    (lambda r: r.predict(np.ones((3, 2)), 0), ValueError, "X has 2 features where 1"),
    (lambda r: r.predict(np.full((2, 1), np.nan), 0), ValueError, "must be finite"),
    (lambda r: r.predict(np.ones((2, 1)), 2), ValueError, "task must be an index in 0..1"),
    (lambda r: r.predict(np.ones((2, 1)), "1"), TypeError, "task must be"),
    (lambda r: r.predict(np.ones((2, 1)), 0, client="z"), KeyError, "no client named"),
    (lambda r: r.predict(np.ones((2, 1)), 0, client=5), IndexError, "out of range"),
    (lambda r: r.predict_proba(np.ones((2, 1)), 0), ValueError, "needs a classification task"),
])
def test_bad_prediction_requests(result, call, error, match):
    with pytest.raises(error, match=match):
        call(result)
