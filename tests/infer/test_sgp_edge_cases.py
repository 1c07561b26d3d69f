"""The sparse GPs' stated behaviour at the edges (issue 17's bad input): a client with fewer
points than inducing points runs and keeps the server state finite; more inducing points than
pooled data is refused before anything compiles; duplicate fixed inducing inputs warn (only the
jitter keeps K_ZZ invertible) and still give a finite state."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fedppl
from fedppl.algorithms import sgp_pvi
from fedppl.families import gaussian as g
from fedppl.infer.base import Runtime
from fedppl.runtime import make_round

SGP = ("dpo", "cpo", "fedavg-z", "fixed", "global")


def _clients(sizes, seed=0):
    rng = np.random.default_rng(seed)
    parts = []
    for n in sizes:
        X = rng.uniform(-3, 3, (n, 1))
        parts.append((X, np.sin(X[:, 0])))
    return fedppl.Clients.from_list(parts)


def _front(method, **settings):
    if method == "fsgp":
        return fedppl.FSGP(local_steps=3, **settings)
    return fedppl.FederatedSGP(method, local_steps=3, inner_steps=3, **settings)


def _finite(tree):
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    return all(np.all(np.isfinite(x)) for x in leaves if np.issubdtype(x.dtype, np.floating))


@pytest.mark.parametrize("method", [*SGP, "fsgp"])
def test_a_client_with_fewer_points_than_inducing_points_runs(method):
    result = _front(method, num_inducing=5).run(jax.random.key(0), _clients([30, 2, 30]), 2,
                                                progress_bar=False)
    objective = result.history["bound" if method == "fsgp" else "free_energy"]
    state = (result.params, result.stats) if method == "fsgp" else result.state
    assert np.all(np.isfinite(objective)) and _finite(state)
    assert result.history["rejected"].tolist() == [0, 0]


@pytest.mark.parametrize("method", [*SGP, "fsgp"])
def test_more_inducing_points_than_data_is_refused(method):
    with pytest.raises(ValueError, match=r"num_inducing.*exceeds the total number of training"):
        _front(method, num_inducing=50).run(jax.random.key(0), _clients([10, 10, 10]), 1,
                                            progress_bar=False)


@pytest.mark.parametrize("method", SGP)
def test_duplicate_fixed_inducing_inputs_warn_and_stay_finite(method):
    Z = np.array([[0.0], [0.0], [1.0], [1.0]])
    with pytest.warns(UserWarning, match="duplicate rows"):
        result = _front(method, num_inducing=4, fixed_inducing=Z).run(
            jax.random.key(0), _clients([20, 20]), 2, progress_bar=False)
    assert np.all(np.isfinite(result.history["free_energy"])) and _finite(result.state)


@pytest.mark.parametrize("method, settings, refused", [
    ("dpo", {}, "pseudo_init='prior'"), ("global", {}, "pooled data"),
    ("fsgp", {}, "init_inducing='random-normal'"), ("dpo", {"pseudo_init": "prior"}, None),
    ("cpo", {}, None), ("fsgp", {"init_inducing": "random-normal"}, None)])
def test_a_server_without_the_data_refuses_a_set_up_that_reads_them(method, settings, refused):
    """On a deployment (Flower) the server sets up on a stand-in for the clients' data: a set-up
    that would read data values there is refused with the way out, not run on the stand-in."""
    front = _front(method, num_inducing=3, **settings)
    deployment = Runtime(make_round, data_at_server=False)  # a server that holds stand-ins
    if refused is None:
        front.init(jax.random.key(0), _clients([10, 10]), runtime=deployment)
    else:
        with pytest.raises(ValueError, match=refused):
            front.init(jax.random.key(0), _clients([10, 10]), runtime=deployment)


@pytest.mark.parametrize("method", ["dpo", "fedavg-z", "fixed"])
def test_inducing_inputs_can_start_at_the_clients_pseudo_inputs(method):
    """``init_inducing="pseudo-inputs"``: q(Z)'s mean (fixed Z's value) starts at rows of the
    clients' initial pseudo-inputs, which ``pseudo_init="data"`` draws from their data; the
    default starts at N(0, I) draws, which are no data row."""
    clients = _clients([12, 12, 12])
    X = np.concatenate([np.asarray(a) for a, _ in clients.data])

    def start(**settings):
        state = _front(method, num_inducing=6, **settings).init(jax.random.key(0), clients)[0]
        Z = g.to_moments(sgp_pvi.q_z(state))[0] if method == "dpo" else state.z_point
        V = np.asarray(state.pseudo.V)[np.asarray(state.pseudo_mask)]
        return np.asarray(Z), V

    Z, V = start(init_inducing="pseudo-inputs")
    assert len(np.unique(Z, axis=0)) == 6
    assert all(np.any(np.all(np.isclose(z, V), axis=1)) for z in Z)  # a pseudo-input ...
    assert all(np.any(np.all(np.isclose(z, X), axis=1)) for z in Z)  # ... so a data row
    Z, _ = start()
    assert not any(np.any(np.all(np.isclose(z, X), axis=1)) for z in Z)


def test_inducing_inputs_from_pseudo_inputs_need_dpo_factors():
    with pytest.raises(ValueError, match="needs DPO pseudo-inputs; 'cpo'"):
        _front("cpo", num_inducing=3, init_inducing="pseudo-inputs").init(
            jax.random.key(0), _clients([10, 10]))
