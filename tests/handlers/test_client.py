from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer.util import log_density

from fedppl.handlers import client
from tests.conftest import linear_model


def test_padded_rows_are_masked_out():
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(5, 3)), rng.normal(size=5)
    Xp, yp = np.vstack([X, np.zeros((3, 3))]), np.concatenate([y, np.zeros(3)])
    mask = jnp.arange(8) < 5
    values = {"w": jnp.array([0.1, -0.2, 0.3])}
    plain, _ = log_density(linear_model, (X, y), {}, values)
    padded, _ = log_density(client(linear_model, mask=mask), (Xp, yp), {}, values)
    unmasked, _ = log_density(linear_model, (Xp, yp), {}, values)
    np.testing.assert_allclose(padded, plain, rtol=1e-12)
    assert abs(float(unmasked - plain)) > 1e-3


def test_num_data_rescales_the_likelihood_of_a_minibatch():
    rng = np.random.default_rng(1)
    X, y = rng.normal(size=(4, 3)), rng.normal(size=4)
    values = {"w": jnp.zeros(3)}
    prior = dist.Normal(0, 1).log_prob(jnp.zeros(3)).sum()
    full, _ = log_density(client(linear_model, mask=jnp.ones(4, bool)), (X, y), {}, values)
    scaled, _ = log_density(client(linear_model, mask=jnp.ones(4, bool), num_data=40), (X, y), {},
                            values)
    np.testing.assert_allclose(scaled - prior, 10 * (full - prior), rtol=1e-12)


def test_observations_outside_a_data_plate_are_an_error():
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)

    X, y = np.ones((4, 2)), np.ones(4)
    with pytest.raises(ValueError, match="observed site 'y' is not inside a plate"):
        log_density(client(model, mask=jnp.ones(4, bool)), (X, y), {}, {"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="named 'obs'"):
        log_density(client(linear_model, mask=jnp.ones(4, bool), plate="obs"), (X, y), {},
                    {"w": jnp.zeros(2)})
