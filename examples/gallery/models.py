"""A gallery of ordinary NumPyro models, each with a federated data generator.

The models are written as NumPyro's own examples write them: ``numpyro.sample`` with ``dist.*``
priors, per-datum observations inside ``numpyro.plate("data", N)``, and the observed ``y`` as the
last positional argument (``y=None`` gives the prior/posterior predictive). Nothing in them knows
about federation.

Every :class:`Entry` pairs a model with ``make_data(seed)``, which simulates ``K = 10`` clients with
an inhomogeneous split: client sizes differ (shares drawn from a Dirichlet), and clients see shifted
covariates (a per-client mean and scale), different category or mixture proportions, or their own
group. ``make_data`` returns ``(clients_arrays, model_kwargs)``: ``clients_arrays[k]`` is the tuple
of positional arrays client ``k`` passes to ``model(*arrays, **model_kwargs)``. It is deterministic
in ``seed``.

``global_sites=None`` means every latent site is global; the two hierarchical models list their
global sites and keep one group effect per client local (group ``k`` is client ``k``).

Example::

    >>> from examples.gallery import GALLERY
    >>> entry = GALLERY["poisson_regression"]
    >>> clients_arrays, kwargs = entry.make_data(0)
    >>> entry.model(*clients_arrays[0], **kwargs)   # inside a seed handler
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions.transforms import OrderedTransform

__all__ = ["Entry", "GALLERY", "NUM_CLIENTS"]

NUM_CLIENTS = 10


@dataclass(frozen=True)
class Entry:
    """One gallery model: ``make_data(seed) -> (clients_arrays, model_kwargs)``."""

    name: str
    model: Callable
    make_data: Callable[[int], tuple[list[tuple[np.ndarray, ...]], dict]]
    global_sites: tuple[str, ...] | None
    family: str
    description: str


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


def linear_regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w + b, sigma), obs=y)


def poisson_regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(X @ w + b)), obs=y)


def negbin_regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    concentration = numpyro.sample("concentration", dist.Gamma(2.0, 0.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.NegativeBinomial2(jnp.exp(X @ w + b), concentration), obs=y)


def logistic_laplace(X, y=None):
    w = numpyro.sample("w", dist.Laplace(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def logistic_studentt(X, y=None):
    w = numpyro.sample("w", dist.StudentT(3.0, 0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def robust_regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    df = numpyro.sample("df", dist.Gamma(2.0, 0.1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.StudentT(df, X @ w + b, sigma), obs=y)


def hierarchical_intercept(group, X, y=None, *, n_groups):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("groups", n_groups):
        alpha = numpyro.sample("alpha", dist.Normal(mu, tau))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(alpha[group] + X @ w, sigma), obs=y)


def hierarchical_logistic(group, X, y=None, *, n_groups):
    """Random intercept and random slope (on ``X[:, 0]``), fixed effects on the other columns."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 2.5))
    mu_b = numpyro.sample("mu_b", dist.Normal(0.0, 2.5))
    tau_a = numpyro.sample("tau_a", dist.HalfCauchy(1.0))
    tau_b = numpyro.sample("tau_b", dist.HalfCauchy(1.0))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1] - 1]).to_event(1))
    with numpyro.plate("groups", n_groups):
        a = numpyro.sample("a", dist.Normal(mu_a, tau_a))
        b = numpyro.sample("b", dist.Normal(mu_b, tau_b))
    logits = a[group] + b[group] * X[:, 0] + X[:, 1:] @ w
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def gaussian_mixture(y=None, *, num_data=None):
    """Three components with ordered locations (no label switching).

    The locations are ``OrderedTransform`` of a Normal vector: the lowest location is
    Normal(-3, 2) and the log gaps between neighbours are Normal(1, 0.5).
    """
    n = y.shape[0] if y is not None else num_data
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(3)))
    base = dist.Normal(jnp.array([-3.0, 1.0, 1.0]), jnp.array([2.0, 0.5, 0.5])).to_event(1)
    locs = numpyro.sample("locs", dist.TransformedDistribution(base, OrderedTransform()))
    with numpyro.plate("components", 3):
        scales = numpyro.sample("scales", dist.HalfNormal(2.0))
    with numpyro.plate("data", n):
        mixture = dist.MixtureSameFamily(dist.Categorical(probs=weights), dist.Normal(locs, scales))
        numpyro.sample("y", mixture, obs=y)


def mvn_lkj_regression(X, y=None, *, dim=3):
    """Multi-output regression with correlated Gaussian noise: an LKJ prior on the correlation."""
    B = numpyro.sample("B", dist.Normal(0.0, 1.0).expand([X.shape[1], dim]).to_event(2))
    loc = numpyro.sample("loc", dist.Normal(0.0, 5.0).expand([dim]).to_event(1))
    scale = numpyro.sample("scale", dist.HalfNormal(2.5).expand([dim]).to_event(1))
    L_omega = numpyro.sample("L_omega", dist.LKJCholesky(dim, concentration=2.0))
    scale_tril = scale[:, None] * L_omega
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.MultivariateNormal(loc + X @ B, scale_tril=scale_tril), obs=y)


def penalised_logistic(category, X, y=None, *, n_categories):
    """Category effects with a soft sum-to-zero constraint added through ``numpyro.factor``."""
    b = numpyro.sample("b", dist.Normal(0.0, 2.5))
    effects = numpyro.sample("effects", dist.Normal(0.0, 1.0).expand([n_categories]).to_event(1))
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.factor("sum_to_zero", dist.Normal(0.0, 0.1).log_prob(effects.sum()))
    numpyro.deterministic("centred_effects", effects - effects.mean())
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b + effects[category] + X @ w), obs=y)


def subsampled_logistic(X, y=None, *, batch=None):
    """Logistic regression on a large client, one minibatch of ``batch`` rows per step.

    ``batch=None`` uses all rows (the full-data model the references run).
    """
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.5))
    with numpyro.plate("data", X.shape[0], subsample_size=batch) as idx:
        y_batch = jnp.asarray(y)[idx] if y is not None else None
        numpyro.sample("y", dist.Bernoulli(logits=jnp.asarray(X)[idx] @ w + b), obs=y_batch)


def mvn_prior_logistic(X, y=None):
    """Logistic regression whose weights have a correlated (AR(1)) Gaussian prior."""
    D = X.shape[1]
    lags = jnp.abs(jnp.arange(D)[:, None] - jnp.arange(D)[None, :])
    w = numpyro.sample("w", dist.MultivariateNormal(jnp.zeros(D), covariance_matrix=0.6**lags))
    b = numpyro.sample("b", dist.Normal(0.0, 2.5))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def gamma_regression(X, y=None):
    """Positive responses: Gamma with mean ``exp(X w + b)`` and a latent shape."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    shape = numpyro.sample("shape", dist.Gamma(2.0, 0.5))
    mean = jnp.exp(X @ w + b)
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Gamma(shape, shape / mean), obs=y)


# ---------------------------------------------------------------------------------------------
# federated data: uneven client sizes, shifted covariates
# ---------------------------------------------------------------------------------------------


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng([seed, tag])


def _sizes(rng, total: int, min_size: int, K: int = NUM_CLIENTS) -> np.ndarray:
    """Uneven client sizes summing to ``total``: a minimum plus Dirichlet(0.7) shares."""
    shares = rng.dirichlet(np.full(K, 0.7))
    sizes = min_size + np.floor(shares * (total - K * min_size)).astype(int)
    sizes[np.argmax(sizes)] += total - sizes.sum()
    return sizes


def _covariates(rng, sizes, D: int, shift: float = 0.6) -> list[np.ndarray]:
    """Per-client covariates ``m_k + s_k * z`` (client mean shift and per-feature scale)."""
    out = []
    for n in sizes:
        m = rng.normal(0.0, shift, D)
        s = rng.uniform(0.6, 1.4, D)
        out.append(m + s * rng.normal(size=(n, D)))
    return out


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _glm_data(tag: int, total: int, D: int, min_size: int, respond, shift: float = 0.6):
    """Generic generator: ``respond(rng, eta)`` draws y given the linear predictor ``eta``."""

    def make_data(seed: int):
        rng = _rng(seed, tag)
        sizes = _sizes(rng, total, min_size)
        w = rng.normal(0.0, 0.5, D)
        b = rng.normal(0.0, 0.5)
        clients = []
        for X in _covariates(rng, sizes, D, shift):
            clients.append((X, respond(rng, X @ w + b).astype(float)))
        return clients, {}

    return make_data


def _linear_y(rng, eta):
    return eta + 0.8 * rng.normal(size=eta.shape)


def _poisson_y(rng, eta):
    return rng.poisson(np.exp(np.clip(eta, -5.0, 4.0)))


def _negbin_y(rng, eta, phi=3.0):
    mu = np.exp(np.clip(eta, -5.0, 4.0))
    return rng.poisson(rng.gamma(phi, mu / phi))


def _bernoulli_y(rng, eta):
    return rng.random(eta.shape) < _sigmoid(eta)


def _robust_y(rng, eta):
    y = eta + 0.5 * rng.standard_t(3.0, size=eta.shape)
    outliers = rng.random(eta.shape) < 0.03
    return np.where(outliers, y + rng.normal(0.0, 6.0, eta.shape), y)


def _gamma_y(rng, eta, shape=4.0):
    return rng.gamma(shape, np.exp(eta) / shape)


def _sparse_logistic(tag: int, total: int, D: int, min_size: int):
    """Logistic data with a few large weights and many near-zero ones."""

    def make_data(seed: int):
        rng = _rng(seed, tag)
        sizes = _sizes(rng, total, min_size)
        w = np.where(rng.random(D) < 0.4, rng.normal(0.0, 1.5, D), 0.0)
        b = -0.3
        clients = [(X, _bernoulli_y(rng, X @ w + b).astype(float))
                   for X in _covariates(rng, sizes, D)]
        return clients, {}

    return make_data


def _hierarchical_intercept_data(seed: int):
    rng = _rng(seed, 7)
    sizes = _sizes(rng, 800, 20)
    D = 3
    w = rng.normal(0.0, 0.7, D)
    alpha = 1.0 + 1.2 * rng.normal(size=NUM_CLIENTS)
    clients = []
    for k, X in enumerate(_covariates(rng, sizes, D)):
        y = alpha[k] + X @ w + 0.8 * rng.normal(size=len(X))
        clients.append((np.full(len(X), k, dtype=np.int32), X, y))
    return clients, {"n_groups": NUM_CLIENTS}


def _hierarchical_logistic_data(seed: int):
    rng = _rng(seed, 8)
    sizes = _sizes(rng, 1500, 50)
    D = 3
    w = rng.normal(0.0, 0.7, D - 1)
    a = -0.3 + 0.8 * rng.normal(size=NUM_CLIENTS)
    b = 1.0 + 0.5 * rng.normal(size=NUM_CLIENTS)
    clients = []
    for k, X in enumerate(_covariates(rng, sizes, D)):
        eta = a[k] + b[k] * X[:, 0] + X[:, 1:] @ w
        y = _bernoulli_y(rng, eta).astype(float)
        clients.append((np.full(len(X), k, dtype=np.int32), X, y))
    return clients, {"n_groups": NUM_CLIENTS}


def _mixture_data(seed: int):
    """Each client has its own mixture proportions (mostly one or two components)."""
    rng = _rng(seed, 9)
    sizes = _sizes(rng, 900, 30)
    locs, scales = np.array([-3.0, 0.5, 3.5]), np.array([0.7, 1.0, 0.6])
    clients = []
    for n in sizes:
        p = rng.dirichlet(np.full(3, 0.6))
        z = rng.choice(3, size=n, p=p)
        clients.append((locs[z] + scales[z] * rng.normal(size=n),))
    return clients, {}


def _mvn_data(seed: int):
    rng = _rng(seed, 10)
    sizes = _sizes(rng, 600, 20)
    D, dim = 2, 3
    B = rng.normal(0.0, 0.8, (D, dim))
    loc = np.array([1.0, -0.5, 0.0])
    corr = np.array([[1.0, 0.6, -0.3], [0.6, 1.0, 0.2], [-0.3, 0.2, 1.0]])
    scale = np.array([0.5, 1.0, 1.5])
    chol = np.linalg.cholesky(corr * np.outer(scale, scale))
    clients = []
    for X in _covariates(rng, sizes, D):
        clients.append((X, loc + X @ B + rng.normal(size=(len(X), dim)) @ chol.T))
    return clients, {}


def _penalised_data(seed: int):
    """Five categories; each client draws categories with its own proportions."""
    rng = _rng(seed, 11)
    sizes = _sizes(rng, 1200, 30)
    C, D = 5, 3
    effects = np.array([-1.0, -0.3, 0.0, 0.4, 0.9])
    w = rng.normal(0.0, 0.7, D)
    clients = []
    for X in _covariates(rng, sizes, D):
        cat = rng.choice(C, size=len(X), p=rng.dirichlet(np.full(C, 0.8)))
        y = _bernoulli_y(rng, 0.2 + effects[cat] + X @ w).astype(float)
        clients.append((cat.astype(np.int32), X, y))
    return clients, {"n_categories": C}


def _subsampled_data(seed: int):
    clients, _ = _glm_data(12, 2000, 16, 80, _bernoulli_y)(seed)
    return clients, {"batch": 64}


# ---------------------------------------------------------------------------------------------
# the gallery
# ---------------------------------------------------------------------------------------------

_ENTRIES = [
    Entry("linear_regression", linear_regression,
          _glm_data(1, 600, 5, 20, _linear_y), None, "fullrank",
          "Gaussian linear regression, Normal weights, HalfNormal noise scale (7 parameters)."),
    Entry("poisson_regression", poisson_regression,
          _glm_data(2, 800, 4, 20, _poisson_y), None, "fullrank",
          "Poisson regression with a log link; Gaussian priors only (5 parameters)."),
    Entry("negbin_regression", negbin_regression,
          _glm_data(3, 800, 4, 20, _negbin_y), None, "fullrank",
          "NegativeBinomial2 regression, latent Gamma-distributed concentration (6 parameters)."),
    Entry("logistic_laplace", logistic_laplace,
          _sparse_logistic(4, 1000, 8, 25), None, "fullrank",
          "Logistic regression with Laplace weights, sparse truth (9 parameters)."),
    Entry("logistic_studentt", logistic_studentt,
          _sparse_logistic(5, 1000, 8, 25), None, "fullrank",
          "Logistic regression with StudentT(3) weights, sparse truth (9 parameters)."),
    Entry("robust_regression", robust_regression,
          _glm_data(6, 600, 4, 20, _robust_y), None, "fullrank",
          "StudentT likelihood with latent df (Gamma prior), HalfNormal scale; 3% outliers "
          "(7 parameters)."),
    Entry("hierarchical_intercept", hierarchical_intercept,
          _hierarchical_intercept_data, ("mu", "tau", "sigma", "w"), "fullrank",
          "Random-intercept Gaussian model, one group per client; alpha (10) is local, "
          "mu, tau (HalfCauchy), sigma, w (3) global."),
    Entry("hierarchical_logistic", hierarchical_logistic,
          _hierarchical_logistic_data, ("mu_a", "mu_b", "tau_a", "tau_b", "w"), "fullrank",
          "Random intercept and slope logistic model, one group per client; a, b (10 each) "
          "local, HalfCauchy group scales global."),
    Entry("gaussian_mixture", gaussian_mixture, _mixture_data, None, "fullrank",
          "1-D mixture of 3 Gaussians, Dirichlet weights, ordered locations, "
          "marginalised with MixtureSameFamily; clients differ in proportions (8 parameters)."),
    Entry("mvn_lkj_regression", mvn_lkj_regression, _mvn_data, None, "fullrank",
          "3-output regression, MultivariateNormal noise with LKJCholesky correlation and "
          "HalfNormal scales (15 parameters)."),
    Entry("penalised_logistic", penalised_logistic, _penalised_data, None, "fullrank",
          "Logistic regression with category effects, soft sum-to-zero via numpyro.factor, "
          "numpyro.deterministic centred effects (9 parameters)."),
    Entry("subsampled_logistic", subsampled_logistic, _subsampled_data, None, "meanfield",
          "Large-client logistic regression with plate subsampling (batch=64), 2000 rows "
          "(17 parameters)."),
    Entry("mvn_prior_logistic", mvn_prior_logistic,
          _glm_data(13, 800, 6, 20, _bernoulli_y), None, "fullrank",
          "Logistic regression with an AR(1) MultivariateNormal prior on the weights; "
          "Gaussian priors only (7 parameters)."),
    Entry("gamma_regression", gamma_regression,
          _glm_data(14, 600, 4, 20, _gamma_y), None, "fullrank",
          "Gamma regression for positive responses, log mean, latent shape (6 parameters)."),
]

GALLERY: dict[str, Entry] = {e.name: e for e in _ENTRIES}
