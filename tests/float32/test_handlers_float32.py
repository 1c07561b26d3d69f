"""The ``cavity`` and ``client`` handlers in float32 (x64 off; see ``conftest.py``): the cavity's
joint log density is the likelihood plus the cavity's log density over the unconstrained sites,
and padded rows drop out, each to within ``100 eps`` of the size of the terms summed."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer.util import log_density

from fedppl.families import gaussian as g
from fedppl.handlers import cavity, client
from fedppl.sites import SiteLayout
from tests.conftest import linear_model
from tests.float32.conftest import F32, cond, f64, rtol

pytestmark = pytest.mark.usefixtures("no_x64")


def three_site_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    s = numpyro.sample("s", dist.LogNormal(0.0, 0.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, s), obs=y)


@pytest.fixture
def data(no_x64):
    rng = np.random.default_rng(3)
    X = rng.normal(size=(20, 2))
    y = X @ np.array([1.0, -1.0]) + 0.3 + 0.4 * rng.normal(size=20)
    return X.astype(np.float32), y.astype(np.float32)


@pytest.mark.parametrize("family", ["fullrank", "meanfield"])
def test_cavity_log_density_is_likelihood_plus_cavity(data, family):
    X, y = data
    layout = SiteLayout.from_model(three_site_model, X, y)
    assert layout.dtype == F32
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 4))
    cov = a @ a.T + 0.5 * np.eye(4)
    q_full = g.FullGaussian.from_moments(jnp.asarray(rng.normal(size=4), F32),
                                         jnp.asarray(cov, F32))
    q_cav = g.project_diag(q_full) if family == "meanfield" else q_full
    theta = jnp.asarray(rng.normal(size=4) * 0.5, F32)
    values = layout.constrain(theta)
    got, _ = log_density(cavity(three_site_model, q_cav, layout), (X, y), {}, values)
    assert got.dtype == F32
    # float64 reference from the same float32 inputs
    t = np.asarray(theta, np.float64)
    w, b, u = t[layout["w"].slice], t[layout["b"].slice][0], t[layout["s"].slice][0]
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    s = np.exp(u)
    r = (y64 - X64 @ w - b) / s
    lik_terms = -0.5 * r**2 - np.log(s) - 0.5 * np.log(2 * np.pi)
    c = f64(q_cav)
    prec = c.prec if family == "fullrank" else np.diag(c.prec)
    mean = np.linalg.solve(prec, c.nat1)
    dev = t - mean
    maha = dev @ prec @ dev
    logdet = np.linalg.slogdet(prec)[1]
    cav = 0.5 * (logdet - 4 * np.log(2 * np.pi) - maha)
    want = lik_terms.sum() + cav - u  # density of s = exp(u) carries the Jacobian -u
    size = np.abs(lik_terms).sum() + abs(logdet) + maha + abs(u) + 4 * np.log(2 * np.pi)
    err = abs(float(got) - want)
    assert err <= rtol(cond=cond(prec)) * size, (err, size)


def test_client_masks_padded_rows(no_x64):
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(50, 3)).astype(np.float32), rng.normal(size=50).astype(np.float32)
    Xp = np.vstack([X, np.full((14, 3), 7.0, np.float32)])
    yp = np.concatenate([y, np.full(14, -9.0, np.float32)])
    mask = jnp.arange(64) < 50
    values = {"w": jnp.asarray([0.1, -0.2, 0.3], F32)}
    plain, _ = log_density(linear_model, (X, y), {}, values)
    padded, _ = log_density(client(linear_model, mask=mask), (Xp, yp), {}, values)
    unmasked, _ = log_density(linear_model, (Xp, yp), {}, values)
    assert padded.dtype == F32
    # two float32 sums over 50 rows of the same terms, in different orders
    size = float(np.abs(dist.Normal(X @ np.asarray(values["w"]), 0.5).log_prob(y)).sum()) + 3.0
    assert abs(float(padded - plain)) <= rtol() * size
    assert abs(float(unmasked - plain)) > 1.0  # the padding would count: the test can fail
    # minibatch rescaling: num_data / batch times the batch's likelihood
    prior = float(dist.Normal(0.0, 1.0).log_prob(values["w"]).sum())
    scaled, _ = log_density(client(linear_model, mask=mask, num_data=500), (Xp, yp), {}, values)
    np.testing.assert_allclose(float(scaled) - prior, 10 * (float(padded) - prior),
                               rtol=rtol())
