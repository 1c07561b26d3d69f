"""A synchronous DPO round needs memory linear in the number of clients: each client's cavity
sums the others' pseudo-observations, streamed over the client axis (``sgp_guide._streamed``),
where a stacked sum under ``vmap`` over clients needs K^2 (the K = 1000 out-of-memory)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fedppl


def _round_memory(num_clients: int, covariance: str) -> int:
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (20 * num_clients, 1))
    clients = fedppl.partition.homogeneous(X, np.sin(X[:, 0]), num_clients=num_clients, seed=0)
    method = fedppl.FederatedSGP("dpo", num_inducing=5, local_steps=2, covariance=covariance,
                                 schedule="synchronous")
    state = method.init(jax.random.key(0), clients)
    return method.lower_round(state).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("covariance", ["diag", "full"])
def test_dpo_round_memory_grows_linearly_with_clients(covariance):
    small, large = _round_memory(10, covariance), _round_memory(40, covariance)
    # linear is 4x, the old stacked sum about 16x
    assert large / small < 5.0, (small, large)
