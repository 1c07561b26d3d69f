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
    np.testing.assert_array_equal(steps, [1.0, pvi.NOT_FINITE, 1.0])
    np.testing.assert_allclose(new.q.prec, 2.0 * jnp.eye(2))
    np.testing.assert_allclose(new.q.nat1, [2.0, 0.0])
    assert int(new.round) == 1


def test_a_message_that_alone_makes_q_improper_is_refused_not_shrunk():
    s = state()
    good = (jnp.array([1.0, 0.0]), 0.5 * jnp.eye(2))
    improper = (jnp.zeros(2), -1.5 * jnp.eye(2))  # q's precision would be -0.5 I
    new, replies = pvi.server_update(s, messages([good, improper]))
    np.testing.assert_array_equal(replies, [1.0, pvi.NOT_PD])
    np.testing.assert_allclose(new.q.prec, 1.5 * jnp.eye(2))  # the good one at its full step


def test_step_is_halved_until_the_combined_update_is_positive_definite():
    """Each message alone keeps q proper (precision 0.4 I), the two together would not: the
    combined step is halved, and q = prior * prod t_k holds on both sides."""
    s = state()
    shrink = (jnp.zeros(2), -0.6 * jnp.eye(2))
    new, steps = pvi.server_update(s, messages([shrink, shrink]))
    np.testing.assert_array_equal(steps, [0.5, 0.5])
    assert bool(g.is_pd(new.q))
    factors = pvi.acknowledge(pvi.ClientState(g.FullGaussian(jnp.zeros((2, 2)),
                                                             jnp.zeros((2, 2, 2)))),
                              messages([shrink, shrink]), steps).factor
    np.testing.assert_allclose(factors.prec[0], -0.3 * jnp.eye(2))
    np.testing.assert_allclose(new.q.prec, jnp.eye(2) + factors.prec.sum(0))


def test_implausibly_large_finite_messages_are_refused_and_not_applied():
    """Entries of 1e12 (in the precision, or in the mean's natural parameter alone) are refused
    by the divergence bound; a message a client's data could carry passes."""
    s = state()
    honest = (jnp.array([50.0, -20.0]), 100.0 * jnp.eye(2))
    huge = (jnp.array([1e12, 1e12]), 1e12 * jnp.eye(2))
    shifted = (jnp.array([1e12, 0.0]), jnp.zeros((2, 2)))
    bad = (jnp.array([jnp.inf, 0.0]), jnp.eye(2))
    new, replies = pvi.server_update(s, messages([honest, huge, shifted, bad]))
    np.testing.assert_array_equal(replies, [1.0, pvi.IMPLAUSIBLE, pvi.IMPLAUSIBLE,
                                            pvi.NOT_FINITE])
    np.testing.assert_allclose(new.q.prec, 101.0 * jnp.eye(2))
    # the bound is the caller's: a tight one refuses the honest message too, none is refused
    # by a loose one
    _, replies = pvi.server_update(s, messages([honest]), max_divergence=1.0)
    np.testing.assert_array_equal(replies, [pvi.IMPLAUSIBLE])
    _, replies = pvi.server_update(s, messages([huge]), max_divergence=1e15)
    np.testing.assert_array_equal(replies, [1.0])
    # a refused client's factor is unchanged by the acknowledgement
    factors = pvi.acknowledge(pvi.ClientState(g.FullGaussian(jnp.zeros((1, 2)),
                                                             jnp.zeros((1, 2, 2)))),
                              messages([huge]), jnp.array([pvi.IMPLAUSIBLE])).factor
    np.testing.assert_array_equal(factors.prec, 0.0)


def test_verdicts_diagonal_family():
    q = g.DiagGaussian(jnp.zeros(3), jnp.ones(3))
    deltas = g.DiagGaussian(jnp.array([[1.0, 0, 0], [0, 0, 0], [0, 0, 0], [jnp.nan, 0, 0]]),
                            jnp.array([[1.0, 2, 3], [-2.0, 0, 0], [1e13, 1e13, 1e13],
                                       [1.0, 1, 1]]))
    np.testing.assert_array_equal(pvi.verdicts(q, deltas),
                                  [1.0, pvi.NOT_PD, pvi.IMPLAUSIBLE, pvi.NOT_FINITE])


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



def test_adaptive_line_search_scores_only_the_rounds_it_flags():
    """``adaptive``: a full step that moves q no further than the last update did is taken
    unscored; one that moves it further, or leaves q not positive definite, is scored (and here
    halved, as the score asks); :func:`pvi.was_scored` tells the rounds apart afterwards."""
    s = state()
    move = (jnp.array([3.0, 0.0]), jnp.zeros((2, 2)))
    full = float(g.kl(pvi.server_update(s, messages([move]))[0].q, s.q))  # 4.5 nats

    def score(q):  # best at mean (1, 0): the full step to 3 lowers it
        mean, _ = g.to_moments(q)
        return -jnp.sum((mean - jnp.array([1.0, 0.0])) ** 2, keepdims=True), jnp.zeros(())

    def run(before, msgs):
        new, steps = pvi.server_update(before, msgs, score=score, adaptive=True)
        return new, steps, bool(pvi.was_scored(before.q, before.moved, new.q, jnp.max(steps)))

    assert float(s.moved) == np.inf  # before the first update
    new, steps, scored = run(s._replace(moved=jnp.asarray(2.0 * full)), messages([move]))
    assert float(steps[0]) == 1.0 and not scored  # not flagged: the score unused
    np.testing.assert_allclose(float(new.moved), full)
    new, steps, scored = run(s._replace(moved=jnp.asarray(0.5 * full)), messages([move]))
    assert float(steps[0]) == 0.5 and scored  # further than the last update: scored
    shrink = (jnp.zeros(2), -0.6 * jnp.eye(2))  # together not positive definite at step 1
    new, steps, scored = run(s, messages([shrink, shrink]))
    assert float(steps[0]) == 0.5 and scored
    # every round scored without adaptive: the full step is halved even when not flagged
    new, steps = pvi.server_update(s._replace(moved=jnp.asarray(2.0 * full)), messages([move]),
                                   score=score)
    assert float(steps[0]) == 0.5
