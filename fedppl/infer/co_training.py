"""Run private GP co-training between any number of parties (thesis Ch. 4).

Example::

    >>> parties = [PartyData(X1, y1, pool1, test1), PartyData(X2, y2, pool2, test2)]
    >>> out = run(parties, y_test, Settings("noisy", "full"), rounds=25, seed=0)
    >>> out.rmse_before, out.rmse_after, out.epsilon         # per party
    >>> out.messages[:3]                                      # Query / Response objects
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
from jax import Array

from fedppl import metrics
from fedppl.algorithms import cotraining as ct

__all__ = ["PartyData", "CoTrainingResult", "run"]


class PartyData(NamedTuple):
    """One party's arrays, all in its own view: labelled inputs and labels, its view of the
    shared pool (same rows for every party) and of the test inputs."""

    X: Array
    y: Array
    pool: Array
    test: Array


@dataclass
class CoTrainingResult:
    rmse_before: list[float]
    rmse_after: list[float]
    messages: list = field(default_factory=list)
    epsilon: list[float | None] = field(default_factory=list)
    states: list = field(default_factory=list)

    def queried(self, party: int) -> list[int]:
        """Pool indices queried by ``party``, in order."""
        return [m.pool_index for m in self.messages
                if isinstance(m, ct.Query) and m.sender == party]


def run(parties: Sequence[PartyData], y_test: Array, settings: ct.Settings = ct.Settings(),
        rounds: int = 25, seed: int = 0, fit_steps: int = 300) -> CoTrainingResult:
    """Fit every party, then ``rounds`` rounds in which each party queries once, in turn."""
    ct._check_settings(settings)
    if len(parties) < 2:
        raise ValueError("co-training needs at least two parties")
    n_pool = np.shape(parties[0].pool)[0]
    for v, p in enumerate(parties):
        if np.shape(p.pool)[0] != n_pool:
            raise ValueError(f"party {v}'s pool has {np.shape(p.pool)[0]} points but party 0's "
                             f"has {n_pool}: the parties must index the same pool")
        if np.shape(p.test)[0] != np.shape(y_test)[0]:
            raise ValueError(f"party {v} has {np.shape(p.test)[0]} test inputs for "
                             f"{np.shape(y_test)[0]} test targets")
    if rounds > n_pool:
        raise ValueError(f"{rounds} rounds need {rounds} distinct pool points per party; the "
                         f"pool has {n_pool}")
    rng = np.random.default_rng(seed)
    states = [ct.init_party(v, p.X, p.y, p.pool, fit_steps, settings.dp)
              for v, p in enumerate(parties)]
    before = [_rmse(s, p.test, y_test, settings) for s, p in zip(states, parties)]
    messages: list = []
    for _ in range(rounds):
        for a in range(len(states)):
            query = ct.make_query(states[a], settings)
            messages.append(query)
            for b in range(len(states)):
                if b == a:
                    continue
                response, states[b] = ct.respond(states[b], query, settings, rng)
                messages.append(response)
                states[a] = ct.receive(states[a], response, settings)
    after = [_rmse(s, p.test, y_test, settings) for s, p in zip(states, parties)]
    eps = [None if s.accountant is None else s.accountant.epsilon(settings.dp.delta)
           for s in states]
    return CoTrainingResult(before, after, messages, eps, states)


def _rmse(state: ct.PartyState, X_test: Array, y_test: Array, settings: ct.Settings) -> float:
    mean, _ = ct.predict(state, X_test, settings)
    return metrics.rmse(y_test, np.asarray(mean))
