"""Linear-model-of-coregionalisation multi-output GP with mixed regression/logistic tasks.

``B`` independent latent GPs ``g_b`` (each with its own base kernel on top of its own optional
deep feature map ``eta_theta_b``, :func:`features`) are mixed into task functions
``f_t(x) = sum_b W[t, b] g_b(x)``.
Task ``t`` is either Gaussian regression (noise variance ``exp(log_noise[t])``) or
Bernoulli-logit classification with labels in {0, 1}. Inference is sparse: ``u_b = g_b(Z)`` at
``M`` inducing inputs ``Z`` (per client, drawn from that client's own inputs, never sent) and
``f | u`` keeps its exact conditional mean *and* variance (the Titsias/SVGP construction; the
paper's Eq. 13 drops the variance, which makes the bound loose; with it the regression-only
ELBO equals the collapsed SGPR bound at the optimum).

Pure-JAX pieces: :func:`kernel`, :func:`projections` (rows ``phi_n`` with
``E[f_n | u] = phi_n^T u``), :func:`cavi_qu` (closed-form ``q(u)`` given Gaussian sites),
:func:`sites`, :func:`update_c` (``q(omega) = PG(1, c)``, ``c = sqrt(E f^2)``), :func:`elbo`
(Eq. 15 with ``u`` in place of ``f``), :func:`exact_elbo` (Gauss-Hermite logistic term),
:func:`noise_stats` (Eq. 20 sufficient statistics), :func:`predict`.

Observations of one client are flat arrays: ``Data(X (N, D), y (N,), task (N,) int, mask (N,))``;
padding rows have ``mask = False`` and contribute nothing; a task without rows is simply absent.
:func:`multitask_clients` turns per-task arrays of many clients into a :class:`fedppl.Clients`
of ``(X, y, task)`` (the form :class:`fedppl.infer.multitask_gp.PFedMul` takes).

Example::

    >>> import numpy as np
    >>> spec = MOGPSpec(kinds=("regression", "classification"), num_latent=2)
    >>> hyper = init_hyper(spec, input_dim=1, key=jax.random.PRNGKey(0))
    >>> x = np.linspace(0.0, 5.0, 12)[:, None]
    >>> data = client_data([x, x], [np.sin(x[:, 0]), (x[:, 0] > 2).astype(float)], spec)
    >>> Z = sample_inducing(jax.random.PRNGKey(1), data, 6)
    >>> q, c = prior_qu(spec, hyper, Z), jnp.zeros(data.y.shape)
    >>> for _ in range(5):
    ...     c = update_c(spec, hyper, Z, data, q); q = cavi_qu(spec, hyper, Z, data, c)
    >>> mean, var = predict(spec, hyper, Z, q, x[:3], task=1)
    >>> mean.shape, bool(jnp.all(var > 0))
    ((3,), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array

from fedppl.clients import Clients
from fedppl.families import polya_gamma as pg
from fedppl.models import kernels, sparse_gp
from fedppl.models.networks import MLP

__all__ = ["MOGPSpec", "Hyper", "Data", "QU", "KERNELS", "kernel", "init_hyper", "client_data",
           "multitask_clients", "sample_inducing", "projections", "prior_qu",
           "sites", "cavi_qu", "update_c", "marginals", "elbo", "exact_elbo", "noise_stats",
           "predict", "kl_qu", "mogp_model", "kzz_chol", "features"]

KERNELS = ("rbf", "laplace", "cauchy", "linear")
TASK_KINDS = ("regression", "classification")


class MOGPSpec(NamedTuple):
    """Static description: task kinds (one per task), number of latent GPs, base kernel."""
    kinds: tuple[str, ...]
    num_latent: int = 2
    kernel: str = "rbf"
    jitter: float = 1e-6


class Hyper(NamedTuple):
    """Prior hyperparameters Theta. ``net``: the deep-kernel feature map, a
    :class:`~fedppl.models.networks.MLP` (the identity when it has no layers) shared by every
    latent GP, or a tuple of ``B`` MLPs, one per latent GP (the paper's ``theta_b``)."""
    net: MLP | tuple[MLP, ...]
    log_phi0: Array   # (B,) kernel variances
    log_phi1: Array   # (B,) kernel rates (inverse squared lengthscales)
    W: Array          # (T, B) mixing weights
    log_noise: Array  # (T,) regression noise variances (unused for classification tasks)


class Data(NamedTuple):
    X: Array
    y: Array
    task: Array
    mask: Array


class QU(NamedTuple):
    """Gaussian ``q(u)`` over the stacked inducing outputs ``u = [u_1; ...; u_B]`` (B*M,)."""
    mean: Array
    cov: Array


# ----------------------------------------------------------------------------- kernels
def kernel(kind: str, X1: Array, X2: Array, phi0: Array, phi1: Array) -> Array:
    """Base kernels of App. F (from :mod:`fedppl.models.kernels`): rbf ``phi0 exp(-phi1/2
    |d|_2^2)``, laplace ``phi0 exp(-phi1/2 |d|_1)``, cauchy ``phi0 / (phi1 |d|_2^2 + 1)`` (a
    variance ``phi0`` added to App. F's form), linear ``phi0 x^T x'`` on L2-normalised inputs
    (``phi1`` unused)."""
    if kind == "rbf":
        return kernels.se(X1, X2, jax.lax.rsqrt(phi1), phi0)
    if kind == "laplace":
        return kernels.gram(kernels.laplace_point, X1, X2, phi1, phi0)
    if kind == "cauchy":
        return kernels.gram(kernels.cauchy_point, X1, X2, phi1, phi0)
    if kind == "linear":
        return kernels.gram(kernels.cosine_point, X1, X2, phi0)
    raise ValueError(f"unknown kernel {kind!r}; choose from {KERNELS}")


def _kernel_diag(kind: str, X: Array, phi0: Array) -> Array:
    return jnp.full(X.shape[0], phi0)  # every base kernel has k(x, x) = phi0


def init_hyper(spec: MOGPSpec, input_dim: int, key: Array | None = None,
               hidden: Sequence[int] = (), phi0: float | Sequence[float] = 1.0,
               phi1: float | Sequence[float] = 0.01, W: Array | None = None,
               noise: float = 0.1, per_latent: bool = True) -> Hyper:
    """Hyperparameters with the paper's real-data defaults (phi0 = 1, phi1 = 0.01, sigma^2 =
    0.1); ``W`` defaults to a random N(0, 1) draw from ``key`` (identity-like if no key).

    Every latent GP ``b`` has its own network ``theta_b`` (Eq. 1c and App. D list
    ``{phi_b, theta_b}``), each drawn from its own key, as a tuple of ``B`` MLPs;
    ``per_latent=False`` gives the ``B`` latents one shared network instead (on the few-shot
    digits study pFed-Mul's accuracy then trails pFed-St's, which has one network per task)."""
    T, B = len(spec.kinds), spec.num_latent
    for k in spec.kinds:
        if k not in TASK_KINDS:
            raise ValueError(f"task kind {k!r} is not one of {TASK_KINDS}")
    key = jax.random.PRNGKey(0) if key is None else key
    knet, kw = jax.random.split(key)
    net: MLP | tuple[MLP, ...] = MLP((input_dim, *hidden), key=knet)
    if per_latent:
        net = tuple(MLP((input_dim, *hidden), key=k) for k in jax.random.split(knet, B))
    if W is None:
        W = jax.random.normal(kw, (T, B))
    return Hyper(net, jnp.log(jnp.broadcast_to(jnp.asarray(phi0, float), (B,))),
                 jnp.log(jnp.broadcast_to(jnp.asarray(phi1, float), (B,))),
                 jnp.asarray(W, float), jnp.full((T,), jnp.log(noise), dtype=float))


# ----------------------------------------------------------------------------- data
def client_data(Xs: Sequence, ys: Sequence, spec: MOGPSpec, client: int | str = 0) -> Data:
    """Flatten per-task arrays (``None`` or empty = task absent on this client) and validate:
    non-finite inputs/targets or labels outside {0, 1} raise ValueError naming the client."""
    if len(Xs) != len(spec.kinds) or len(ys) != len(spec.kinds):
        raise ValueError(f"client {client}: expected {len(spec.kinds)} tasks, got {len(Xs)}")
    rows, dims = [], {np.asarray(x).shape[-1] for x in Xs if x is not None and len(x)}
    if len(dims) > 1:
        raise ValueError(f"client {client}: tasks have different input dimensions {dims}")
    for t, (x, y) in enumerate(zip(Xs, ys, strict=True)):
        if x is None or len(x) == 0:
            continue
        x, y = np.asarray(x, float), np.asarray(y, float).reshape(-1)
        x = x.reshape(len(x), -1)
        if len(x) != len(y):
            raise ValueError(f"client {client}, task {t}: {len(x)} inputs but {len(y)} targets")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"client {client}, task {t}: inputs contain NaN or inf")
        if not np.all(np.isfinite(y)):
            raise ValueError(f"client {client}, task {t}: targets contain NaN or inf")
        if spec.kinds[t] == "classification" and not np.all((y == 0) | (y == 1)):
            bad = np.unique(y[(y != 0) & (y != 1)])[:5]
            raise ValueError(f"client {client}, task {t}: classification labels must be in "
                             f"{{0, 1}}, got {bad.tolist()}")
        rows.append((x, y, np.full(len(y), t)))
    if not rows:
        raise ValueError(f"client {client}: no data in any task")
    X = np.concatenate([r[0] for r in rows])
    return Data(jnp.asarray(X), jnp.asarray(np.concatenate([r[1] for r in rows])),
                jnp.asarray(np.concatenate([r[2] for r in rows]), dtype=jnp.int32),
                jnp.ones(len(X), bool))


def multitask_clients(per_client: Sequence[tuple[Sequence, Sequence]], spec: MOGPSpec,
                      names: Sequence[str] = ()) -> Clients:
    """``[(Xs, ys), ...]`` (per client, per-task arrays as for :func:`client_data`) as
    :class:`~fedppl.clients.Clients` of ``(X, y, task)``, each client checked by
    :func:`client_data`."""
    if len(per_client) == 0:
        raise ValueError("there are no clients")
    rows = []
    for k, (Xs, ys) in enumerate(per_client):
        d = client_data(Xs, ys, spec, client=names[k] if names else k)
        rows.append((np.asarray(d.X), np.asarray(d.y), np.asarray(d.task)))
    return Clients.from_list(rows, tuple(names))


def sample_inducing(key: Array, data: Data, num: int) -> Array:
    """``min(num, N)`` distinct rows of the client's own (unmasked) inputs, uniformly (App. C)."""
    idx = np.flatnonzero(np.asarray(data.mask))
    pick = jax.random.choice(key, jnp.asarray(idx), (min(num, len(idx)),), replace=False)
    return data.X[pick]


# ----------------------------------------------------------------------------- inference
def features(hyper: Hyper, X: Array) -> Array:
    """The deep-kernel features of every latent GP, ``(B, N, d)``: one network per latent when
    ``hyper.net`` is a tuple, else the one shared network's features repeated ``B`` times."""
    B = hyper.log_phi0.shape[0]
    if isinstance(hyper.net, tuple):
        return jnp.stack([net(X) for net in hyper.net])
    H = hyper.net(X)
    return jnp.broadcast_to(H, (B, *H.shape))


def kzz_chol(spec: MOGPSpec, hyper: Hyper, H: Array) -> tuple[Array, Array]:
    """Per-latent Gram matrices ``K_b(Z, Z)`` (+ jitter) and their Cholesky factors (B, M, M) at
    the projected inducing inputs ``H = features(hyper, Z)`` (B, M, d; or (M, d), shared)."""
    phi0, phi1 = jnp.exp(hyper.log_phi0), jnp.exp(hyper.log_phi1)
    if H.ndim == 2:
        H = jnp.broadcast_to(H, (phi0.shape[0], *H.shape))
    K = jax.vmap(lambda a, b, h: kernel(spec.kernel, h, h, a, b))(phi0, phi1, H)
    K = K + spec.jitter * phi0[:, None, None] * jnp.eye(H.shape[1])
    return K, jnp.linalg.cholesky(K)


@partial(jax.jit, static_argnums=0)
def projections(spec: MOGPSpec, hyper: Hyper, Z: Array, X: Array, task: Array
                ) -> tuple[Array, Array, Array, Array]:
    """``Phi (N, B*M)`` with ``E[f_{task_n}(x_n) | u] = Phi[n] @ u``, the conditional variances
    ``Var[f_n | u] (N,)``, whitened rows ``Psi = Phi L`` and the factors ``L (B, M, M)``."""
    HZ, HX = features(hyper, Z), features(hyper, X)
    phi0, phi1 = jnp.exp(hyper.log_phi0), jnp.exp(hyper.log_phi1)
    _, L = kzz_chol(spec, hyper, HZ)
    Kzx = jax.vmap(lambda a, b, hz, hx: kernel(spec.kernel, hz, hx, a, b))(
        phi0, phi1, HZ, HX)  # (B, M, N)
    half = jax.vmap(lambda l, k: jax.scipy.linalg.solve_triangular(l, k, lower=True))(L, Kzx)
    A = jax.vmap(lambda l, h: jax.scipy.linalg.solve_triangular(l.T, h, lower=False))(L, half)
    w = hyper.W[task]  # (N, B)
    Phi = jnp.einsum("nb,bmn->nbm", w, A)
    Psi = jnp.einsum("nb,bmn->nbm", w, half)
    kdiag = jax.vmap(lambda a: _kernel_diag(spec.kernel, X, a))(phi0)  # (B, N)
    cond = jnp.sum(w.T**2 * jnp.maximum(kdiag - jnp.sum(half**2, 1), 0.0), 0)
    n = X.shape[0]
    return Phi.reshape(n, -1), cond, Psi.reshape(n, -1), L


def _block_diag(L: Array) -> Array:
    return jax.scipy.linalg.block_diag(*[L[b] for b in range(L.shape[0])])


@partial(jax.jit, static_argnums=0)
def prior_qu(spec: MOGPSpec, hyper: Hyper, Z: Array) -> QU:
    """``q(u) = p(u) = N(0, blockdiag K_b(Z, Z))``."""
    K, _ = kzz_chol(spec, hyper, features(hyper, Z))
    return QU(jnp.zeros(K.shape[0] * K.shape[1]), _block_diag(K))


def sites(spec: MOGPSpec, hyper: Hyper, data: Data, c: Array) -> tuple[Array, Array]:
    """Gaussian site precisions ``lam`` and natural means ``eta`` per observation: regression
    ``(1/sigma_t^2, y/sigma_t^2)``, classification ``(E[omega], y - 1/2)`` (App. A-B)."""
    is_cls = jnp.asarray([k == "classification" for k in spec.kinds])[data.task]
    inv_noise = jnp.exp(-hyper.log_noise)[data.task]
    kappa, e_omega = pg.gaussian_site(data.y, c)
    lam = jnp.where(is_cls, e_omega, inv_noise)
    eta = jnp.where(is_cls, kappa, data.y * inv_noise)
    return lam * data.mask, eta * data.mask


@partial(jax.jit, static_argnums=0)
def cavi_qu(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, c: Array) -> QU:
    """Closed-form optimal ``q(u)`` given ``q(omega)``: precision ``K^-1 + Phi^T Lam Phi`` and
    mean ``Sigma Phi^T eta`` (Eq. 14 / App. C), in the whitened coordinates of
    :func:`fedppl.models.sparse_gp.posterior` (``Psi = Phi L``)."""
    _, _, Psi, L = projections(spec, hyper, Z, data.X, data.task)
    lam, eta = sites(spec, hyper, data, c)
    whitened = sparse_gp.posterior(_block_diag(L), (Psi * lam[:, None]).T @ Psi, Psi.T @ eta)
    return QU(*sparse_gp.moments(whitened))


@partial(jax.jit, static_argnums=0)
def marginals(spec: MOGPSpec, hyper: Hyper, Z: Array, X: Array, task: Array, q: QU
              ) -> tuple[Array, Array]:
    """Mean and variance of ``f_{task_n}(x_n)`` under ``q(u) p(f | u)``."""
    Phi, cond, _, _ = projections(spec, hyper, Z, X, task)
    return Phi @ q.mean, jnp.sum((Phi @ q.cov) * Phi, 1) + cond


@partial(jax.jit, static_argnums=0)
def update_c(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU) -> Array:
    """Optimal ``q(omega_n) = PG(1, c_n)`` with ``c_n = sqrt(E[f_n^2])`` (Eq. 3a)."""
    m, v = marginals(spec, hyper, Z, data.X, data.task, q)
    return pg.optimal_c(m, v)


@partial(jax.jit, static_argnums=0)
def kl_qu(spec: MOGPSpec, hyper: Hyper, Z: Array, q: QU) -> Array:
    """``KL[q(u) || p(u)]`` with the block-diagonal prior (Eq. 18)."""
    _, L = kzz_chol(spec, hyper, features(hyper, Z))
    B, M = L.shape[0], L.shape[1]
    mb, Sb = q.mean.reshape(B, M), q.cov.reshape(B, M, B, M)
    Sbb = jnp.stack([Sb[b, :, b, :] for b in range(B)])
    trace = jnp.sum(jax.vmap(lambda l, s: jnp.trace(jax.scipy.linalg.cho_solve((l, True), s)))(
        L, Sbb))
    maha = jnp.sum(jax.vmap(lambda l, m: jnp.sum(jax.scipy.linalg.solve_triangular(
        l, m, lower=True) ** 2))(L, mb))
    logdet_k = 2.0 * jnp.sum(jnp.log(jnp.diagonal(L, axis1=1, axis2=2)))
    logdet_s = 2.0 * jnp.sum(jnp.log(jnp.diag(jnp.linalg.cholesky(q.cov))))
    return 0.5 * (trace + maha - B * M + logdet_k - logdet_s)


def _regression_terms(spec: MOGPSpec, hyper: Hyper, data: Data, m: Array, v: Array) -> Array:
    s2 = jnp.exp(hyper.log_noise)[data.task]
    return -0.5 * jnp.log(2 * jnp.pi * s2) - (data.y**2 - 2 * data.y * m + m**2 + v) / (2 * s2)


@partial(jax.jit, static_argnums=0)
def elbo(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU, c: Array) -> Array:
    """Augmented ELBO (Eq. 15): regression (16a) + Polya-Gamma classification (16b) - KL of
    ``q(omega)`` (17) - ``KL[q(u) || p(u)]`` (18). Equals the Jaakkola-Jordan bound at the
    optimal ``c``."""
    m, v = marginals(spec, hyper, Z, data.X, data.task, q)
    is_cls = jnp.asarray([k == "classification" for k in spec.kinds])[data.task]
    cls = pg.augmented_bound(data.y, m, v, c)
    reg = _regression_terms(spec, hyper, data, m, v)
    per = jnp.where(is_cls, cls, reg)
    return jnp.sum(jnp.where(data.mask, per, 0.0)) - kl_qu(spec, hyper, Z, q)


@partial(jax.jit, static_argnums=0, static_argnames="order")
def exact_elbo(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU, order: int = 32
               ) -> Array:
    """ELBO of ``q(u)`` under the exact (non-augmented) likelihoods, the logistic term by
    ``order``-point Gauss-Hermite quadrature: a common yardstick for pFed-Mul and Gaussian VI."""
    m, v = marginals(spec, hyper, Z, data.X, data.task, q)
    x, w = np.polynomial.hermite_e.hermegauss(order)
    f = m[:, None] + jnp.sqrt(v)[:, None] * x[None, :]
    sign = (2.0 * data.y - 1.0)[:, None]
    cls = jnp.sum(jax.nn.log_sigmoid(sign * f) * w, 1) / np.sqrt(2 * np.pi)
    is_cls = jnp.asarray([k == "classification" for k in spec.kinds])[data.task]
    per = jnp.where(is_cls, cls, _regression_terms(spec, hyper, data, m, v))
    return jnp.sum(jnp.where(data.mask, per, 0.0)) - kl_qu(spec, hyper, Z, q)


@partial(jax.jit, static_argnums=0)
def noise_stats(spec: MOGPSpec, hyper: Hyper, Z: Array, data: Data, q: QU
                ) -> tuple[Array, Array]:
    """Per task ``(sum_n E[(y_n - f_n)^2], count)`` over regression rows: Eq. 20 gives
    ``sigma_t^2 = sum / count`` (summed over clients when the noise is global)."""
    m, v = marginals(spec, hyper, Z, data.X, data.task, q)
    is_reg = jnp.asarray([k == "regression" for k in spec.kinds])[data.task] & data.mask
    r = jnp.where(is_reg, data.y**2 - 2 * data.y * m + m**2 + v, 0.0)
    onehot = jax.nn.one_hot(data.task, len(spec.kinds)) * is_reg[:, None]
    return onehot.T @ r, onehot.sum(0)


def predict(spec: MOGPSpec, hyper: Hyper, Z: Array, q: QU, X: Array, task: int
            ) -> tuple[Array, Array]:
    """Posterior mean and variance of the latent ``f_task`` at ``X`` (Eq. 4, sparse form)."""
    return marginals(spec, hyper, Z, X, jnp.full(X.shape[0], task, jnp.int32), q)


# ----------------------------------------------------------------------------- NumPyro model
def mogp_model(X: Array, task: Array, spec: MOGPSpec, hyper: Hyper, Z: Array,
               y: Array | None = None) -> None:
    """The sparse generative model in NumPyro: ``u_b ~ N(0, K_b(Z, Z))``, ``f_n | u ~
    N(Phi_n u, Var[f_n | u])`` independently, then ``y_n ~ N(f_n, sigma_t^2)`` for regression
    tasks and ``y_n ~ Bernoulli(logits=f_n)`` for classification tasks."""
    K, _ = kzz_chol(spec, hyper, features(hyper, Z))
    us = [numpyro.sample(f"u_{b}", dist.MultivariateNormal(jnp.zeros(K.shape[1]), K[b]))
          for b in range(spec.num_latent)]
    Phi, cond, _, _ = projections(spec, hyper, Z, X, task)
    with numpyro.plate("data", X.shape[0]):
        f = numpyro.sample("f", dist.Normal(Phi @ jnp.concatenate(us), jnp.sqrt(cond + 1e-12)))
        is_cls = jnp.asarray([k == "classification" for k in spec.kinds])[task]
        sd = jnp.exp(0.5 * hyper.log_noise)[task]
        obs_reg = None if y is None else jnp.where(is_cls, 0.0, y)
        obs_cls = None if y is None else jnp.where(is_cls, y, 0.0)
        with numpyro.handlers.mask(mask=~is_cls):
            numpyro.sample("y_reg", dist.Normal(f, sd), obs=obs_reg)
        with numpyro.handlers.mask(mask=is_cls):
            numpyro.sample("y_cls", dist.Bernoulli(logits=f), obs=obs_cls)
