from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO
from numpyro.infer.util import log_density

from fedppl.handlers import tempered


def model(y=None):
    z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    phi = numpyro.sample("phi", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", 3):
        numpyro.sample("y", dist.Normal(z + phi, 1.0), obs=y)


def guide(y=None):
    numpyro.sample("z", dist.Normal(numpyro.param("mz", 0.3), 0.5))
    numpyro.sample("phi", dist.Normal(numpyro.param("mp", -0.2), 0.7))


def test_only_named_latent_sites_are_scaled():
    y = jnp.array([0.1, 0.5, -0.2])
    values = {"z": 0.2, "phi": -0.4}
    base, _ = log_density(model, (y,), {}, values)
    scaled, _ = log_density(tempered(model, alpha=0.1, sites=["phi"]), (y,), {}, values)
    phi_lp = dist.Normal(0.0, 2.0).log_prob(-0.4)
    np.testing.assert_allclose(scaled, base - 0.9 * phi_lp, rtol=1e-12)


def test_elbo_has_alpha_scaled_kl():
    y = jnp.array([0.1, 0.5, -0.2])
    alpha = 0.1
    est = []
    for i in range(8):
        est.append(-Trace_ELBO(num_particles=5000).loss(
            jax.random.key(i), {}, tempered(model, alpha=alpha, sites=["phi"]),
            tempered(guide, alpha=alpha, sites=["phi"]), y))
    est = np.array(est)
    # closed form: E[log lik] - KL(z) - alpha KL(phi)
    mz, sz, mp, sp = 0.3, 0.5, -0.2, 0.7
    ell = np.sum(-0.5 * np.log(2 * np.pi) - 0.5 * ((y - mz - mp) ** 2 + sz**2 + sp**2))
    kl_z = dist.kl_divergence(dist.Normal(mz, sz), dist.Normal(0.0, 1.0))
    kl_p = dist.kl_divergence(dist.Normal(mp, sp), dist.Normal(0.0, 2.0))
    closed = ell - kl_z - alpha * kl_p
    se = est.std(ddof=1) / np.sqrt(len(est))
    assert abs(est.mean() - closed) < 4 * se + 1e-8
    assert abs(est.mean() - (ell - kl_z - kl_p)) > 4 * se  # alpha = 1 would differ


def test_bad_arguments():
    with pytest.raises(ValueError, match="non-negative"):
        tempered(model, alpha=-1.0, sites=["z"])
    with pytest.raises(ValueError, match="at least one site"):
        tempered(model, alpha=0.5, sites=[])
