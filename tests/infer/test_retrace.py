"""Compile once: a round is compiled per (model, guide, settings), not per method object.

Compilations are counted with a ``jax.monitoring`` listener on the event JAX records for every
XLA backend compilation (``/jax/core/compile/backend_compile_duration``): eager operations,
jitted functions and compiled rounds alike. A second ``update`` with the same shapes, and a
second method built with the same model, an equal guide and the same settings, run on clients
of the same shapes, must compile nothing.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fedppl
from fedppl.models import linear_regression, logistic_regression

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COUNT = [0]


def _listener(event: str, duration: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
        _COUNT[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


class Compilations:
    """``with Compilations() as c: ...``; then ``c.count``: backend compilations inside."""

    def __enter__(self):
        self.start = _COUNT[0]
        return self

    def __exit__(self, *exc):
        self.count = _COUNT[0] - self.start


def _clients(seed: int, binary: bool = True):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(80, 2))
    y = (X @ np.array([1.5, -1.0]) + rng.normal(size=80) > 0) * 1.0 if binary else X @ [1, 2.0]
    return fedppl.partition.homogeneous(X, y, num_clients=4, seed=seed)


# name -> () -> a fresh method object (a new guide each time: equal, not the same)
METHODS = {
    "PVI-synchronous": lambda: fedppl.PVI(
        logistic_regression, fedppl.PVIGuide(logistic_regression), "synchronous",
        num_particles=16, local_steps=20, elbo_samples=8),
    "PVI-sequential": lambda: fedppl.PVI(
        linear_regression, fedppl.PVIGuide(linear_regression), "sequential"),
    "GlobalVI": lambda: fedppl.GlobalVI(
        logistic_regression, fedppl.PVIGuide(logistic_regression), num_steps=20,
        num_particles=16, elbo_samples=0),
    "EP": lambda: fedppl.EP(
        linear_regression, fedppl.PVIGuide(linear_regression, family="fullrank"),
        tilted="exact"),
    "OneShot": lambda: fedppl.OneShot(
        linear_regression, fedppl.PVIGuide(linear_regression, family="fullrank"),
        laplace_steps=20),
}


def _data(name: str, seed: int):
    binary = name in ("PVI-synchronous", "GlobalVI")
    return _clients(seed, binary)


def _run(method, clients):
    rounds = 1 if isinstance(method, (fedppl.OneShot, fedppl.GlobalVI)) else 2
    return method.run(jax.random.key(0), clients, rounds, progress_bar=False)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_second_method_with_the_same_settings_compiles_nothing(name):
    first = _run(METHODS[name](), _data(name, 0))
    with Compilations() as c:  # new objects, equal guide, other data of the same shapes
        second = _run(METHODS[name](), _data(name, 1))
    assert c.count == 0, f"{c.count} compilations for a second {name} with the same settings"
    with Compilations() as c:  # the same data again: the same answer, to the bit
        again = _run(METHODS[name](), _data(name, 0))
    assert c.count == 0
    np.testing.assert_array_equal(np.asarray(again.mean_and_cov()[0]),
                                  np.asarray(first.mean_and_cov()[0]))
    assert np.all(np.isfinite(np.asarray(second.mean_and_cov()[0])))


def test_a_second_update_with_the_same_shapes_compiles_nothing():
    pvi = METHODS["PVI-synchronous"]()
    state = pvi.init(jax.random.key(0), _clients(0))
    state, _ = pvi.update(state)
    with Compilations() as c:
        state, info = pvi.update(state)
    assert c.count == 0 and info["round"] == 2


def test_other_settings_compile_their_own_round():
    """The counter counts: a setting that changes the trio (the damping) compiles a round."""
    clients = _clients(0)
    _run(METHODS["PVI-synchronous"](), clients)
    with Compilations() as c:
        fedppl.PVI(logistic_regression, fedppl.PVIGuide(logistic_regression), "synchronous",
                   damping=0.5, num_particles=16, local_steps=20,
                   elbo_samples=8).run(jax.random.key(0), clients, 2, progress_bar=False)
    assert c.count > 0


def test_the_run_state_holds_the_run_and_the_method_holds_none_of_it():
    """``update(state)`` reads the state alone: two runs of one method object interleave."""
    pvi = METHODS["PVI-synchronous"]()
    a = pvi.init(jax.random.key(0), _clients(0))
    b = pvi.init(jax.random.key(0), _clients(1))
    a1, _ = pvi.update(a)
    b1, _ = pvi.update(b)
    a2, _ = pvi.update(a1)
    alone = METHODS["PVI-synchronous"]()
    s = alone.init(jax.random.key(0), _clients(0))
    s2, _ = alone.update(alone.update(s)[0])
    np.testing.assert_array_equal(np.asarray(a2.server.q.nat1), np.asarray(s2.server.q.nat1))
    assert a2.log.last_messages is not None and b1.plan.names == a2.plan.names
    assert not {"_round_fn", "last_messages", "_log", "_names"} & set(vars(pvi))


def test_a_runtime_is_an_argument_not_an_attribute():
    """Setting ``method.runtime`` (read by an earlier version) is an error, not ignored."""
    pvi = METHODS["PVI-sequential"]()
    pvi.runtime = lambda trio, schedule: None
    with pytest.raises(TypeError, match="runtime="):
        pvi.init(jax.random.key(0), _clients(0, binary=False))
