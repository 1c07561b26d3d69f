"""The server's rules: bad deltas rejected, steps halved to keep q positive definite."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fedppl.algorithms import pvi
from fedppl.families import gaussian as g


def state():
    prior = g.FullGaussian(jnp.zeros(2), jnp.eye(2))
    return pvi.init(prior, g.FullGaussian(jnp.zeros((3, 2)), jnp.zeros((3, 2, 2))))


def messages(deltas):
    return pvi.ClientMessage(
        g.FullGaussian(jnp.stack([d[0] for d in deltas]), jnp.stack([d[1] for d in deltas])),
        jnp.zeros(len(deltas)), jnp.zeros(len(deltas), bool), jnp.ones(len(deltas), bool),
        jnp.ones(len(deltas), int))


def test_non_finite_delta_is_rejected_and_the_rest_applied():
    s = state()
    good = (jnp.array([1.0, 0.0]), 0.5 * jnp.eye(2))
    bad = (jnp.array([jnp.nan, 0.0]), jnp.eye(2))
    new, steps = pvi.server_update(s, messages([good, bad, good]))
    np.testing.assert_array_equal(steps, [1.0, 0.0, 1.0])
    np.testing.assert_allclose(new.q.prec, 2.0 * jnp.eye(2))
    np.testing.assert_allclose(new.q.nat1, [2.0, 0.0])
    assert int(new.round) == 1


def test_step_is_halved_until_q_is_positive_definite():
    s = state()
    shrink = (jnp.zeros(2), -1.5 * jnp.eye(2))  # full step would make q's precision -0.5 I
    new, steps = pvi.server_update(s, messages([shrink]))
    assert float(steps[0]) == 0.5
    assert bool(g.is_pd(new.q))
    factors = pvi.acknowledge(pvi.ClientState(g.FullGaussian(jnp.zeros((1, 2)),
                                                             jnp.zeros((1, 2, 2)))),
                              messages([shrink]), steps).factor
    np.testing.assert_allclose(factors.prec[0], -0.75 * jnp.eye(2))
    # q = prior * prod t_k still holds on both sides
    np.testing.assert_allclose(new.q.prec, jnp.eye(2) + factors.prec[0])


def test_line_search_refuses_a_step_that_lowers_the_score():
    """With a score, the server takes the largest step that does not lower it (beyond slack)."""
    s = state()
    move = (jnp.array([3.0, 0.0]), jnp.zeros((2, 2)))  # moves q's mean from 0 to (3, 0)

    def score(q):  # best at mean (1, 0): a full step overshoots to 3 (score -4 < -1 now)
        mean, _ = g.to_moments(q)
        return -jnp.sum((mean - jnp.array([1.0, 0.0])) ** 2, keepdims=True), jnp.zeros(())

    new, steps = pvi.server_update(s, messages([move]), score=score)
    assert float(steps[0]) == 0.5
    np.testing.assert_allclose(g.to_moments(new.q)[0], [1.5, 0.0])
    # without a score the full step is taken
    _, steps = pvi.server_update(s, messages([move]))
    assert float(steps[0]) == 1.0

