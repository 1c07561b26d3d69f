"""One implementation of each schedule, whatever reaches the clients: a round on a host map (the
clients called one by one from Python, as a deployment's nodes are) is the ``vmap`` round, and a
client that does not answer takes no part in the server's update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedppl
from fedppl import trees
from fedppl.algorithms.trio import Trio
from fedppl.models import linear_regression
from fedppl.runtime.embedded import LOOP, VMAP, ClientMap, host_map, make_round

jax.config.update("jax_enable_x64", True)


def remote(silent: frozenset[int] = frozenset()) -> ClientMap:
    """A map that reaches each client by a Python call on host copies of its arrays (its own
    machine), as a deployment's nodes are; the clients in ``silent`` never answer. The server
    keeps its record of a client that did not answer (its proposed state is its old one)."""

    def answer(trio, server, k, client, data, mask, key):
        if int(k) in silent:
            return None
        return jax.device_get(jax.jit(trio.client_update)(
            server, *jax.device_get((client, data, mask)), key, k))

    def blank(trio, server, client, data, mask, key):
        like = jax.eval_shape(trio.client_update, server, client, data, mask, key,
                              jnp.asarray(0))[0]
        return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), like)

    def update(trio, server, clients, data, masks, keys, index, active):
        K = len(active)
        one = [trees.index((clients, data, masks, keys), k) for k in range(K)]
        got = {k: answer(trio, server, k, *one[k]) for k in range(K) if active[k]}
        got = {k: a for k, a in got.items() if a is not None}
        nothing = blank(trio, server, *one[0])
        msgs = trees.stack([got[k][0] if k in got else nothing for k in range(K)])
        proposed = trees.stack([got[k][1] if k in got else one[k][0] for k in range(K)])
        return msgs, proposed, np.array([k in got for k in range(K)])

    def step(trio, server, client, data, mask, key, k):
        got = answer(trio, server, k, client, data, mask, key)
        if got is None:
            return blank(trio, server, client, data, mask, key), client, False
        return got[0], got[1], True

    return host_map(update, step, VMAP.evaluator)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _pvi_run(schedule, runtime):
    """The last round's output of PVI (its line search on) run 3 rounds on ``runtime``."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 2))
    clients = fedppl.partition.homogeneous(X, X @ np.array([1.0, -0.5]) + rng.normal(size=80),
                                           num_clients=4, seed=0)
    method = fedppl.PVI(linear_regression, fedppl.PVIGuide(linear_regression), schedule,
                        damping=0.5, elbo_samples=0)
    last = {}

    def recorded(trio, sched):
        round_fn = runtime(trio, sched)

        def run(*args):
            out = round_fn(*args)
            last["out"] = out
            return out

        return run

    method.run(jax.random.key(0), clients, 3, progress_bar=False, runtime=recorded)
    return last["out"]


def _without(k):
    """The vmap round with client ``k`` sitting every round out."""

    def runtime(trio, schedule):
        round_fn = make_round(trio, schedule)

        def without(server, clients, data, masks, keys, active, server_key):
            return round_fn(server, clients, data, masks, keys,
                            jnp.asarray(active).at[k].set(False), server_key)

        return without

    return runtime


def _lost(k):
    """The vmap round with client ``k``'s message lost every round (it takes part, the server
    never receives it: :class:`fedppl.runtime.faults.Faults`' dropout)."""

    def runtime(trio, schedule):
        def server_update(server, msgs, index, received, key, evaluate):
            return trio.server_update(server, msgs, index, received & (index != k), key,
                                      evaluate)

        return make_round(trio._replace(server_update=server_update), schedule)

    return runtime


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_a_host_map_gives_the_vmap_round(schedule):
    """PVI (with its line search: the server's evaluation on the clients' data) on the remote
    map and the loop map: the server and client states of the vmap round."""
    want = _pvi_run(schedule, make_round)
    for client_map in (remote(), LOOP):
        got = _pvi_run(schedule, lambda trio, s, m=client_map: make_round(trio, s, m))
        for a, b in zip(_leaves(got[:2]), _leaves(want[:2]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_a_client_that_does_not_answer_takes_no_part(schedule):
    """Client 1 never answers: the round is the vmap round with client 1's message lost (the
    server's and clients' states, client 1's reply "not received"), its message in the round's
    output is zeros, and the posterior is that of a run in which client 1 sat every round out
    (a sequential server still counts the turn it gave client 1)."""
    got = _pvi_run(schedule, lambda trio, s: make_round(trio, s, remote(frozenset({1}))))
    lost = _pvi_run(schedule, _lost(1))
    for a, b in zip(_leaves(got[:2]), _leaves(lost[:2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(lost[3]))
    assert all(np.all(m[1] == 0) for m in _leaves(got[2]))
    absent = _pvi_run(schedule, _without(1))
    for a, b in zip(_leaves(got[0].q), _leaves(absent[0].q), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# a toy trio: a client sends its data's sum and proposes its count plus one; the server adds up
# what it received and accepts exactly that (a client keeps its proposal only if accepted)
TOY = Trio(lambda s, c, d, m, k, i: (jnp.sum(d[0] * m) + i, c + 1),
           lambda s, msgs, idx, ok, k, ev: (s + jnp.sum(jnp.where(ok, msgs, 0.0)), ok),
           lambda c, msg, accepted, proposed: jnp.where(accepted, proposed, c))


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
def test_a_silent_client_keeps_its_state_and_counts_for_nothing(schedule):
    """Client 1 silent, client 2 outside the round: the server adds up clients 0 and 3 alone,
    and only they keep their proposals."""
    data, masks = jnp.arange(12.0).reshape(4, 3), jnp.ones((4, 3), bool)
    keys, active = jax.random.split(jax.random.key(0), 4), jnp.array([True, True, False, True])

    def run(client_map, active):
        round_fn = make_round(TOY, schedule, client_map)
        return round_fn(0.0, jnp.zeros(4), (data,), masks, keys, active, jax.random.key(1))

    server, clients, msgs, replies = run(remote(frozenset({1})), active)
    want = run(None, active.at[1].set(False))
    assert float(server) == float(want[0]) == (0 + 1 + 2) + (9 + 10 + 11 + 3)  # sum + index
    assert clients.tolist() == want[1].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert np.asarray(replies).tolist() == [True, False, False, True]
    assert float(msgs[1]) == 0.0


def test_loop_with_a_client_map_is_refused():
    with pytest.raises(ValueError, match="synchronous"):
        make_round(TOY, "loop", LOOP)
