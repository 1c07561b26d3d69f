"""Random-feature kernels: random Fourier features and the unifying random kernel (URK).

A random feature map draws ``m`` samples ``omega_j`` and concatenates ``z_{omega_j}(x)``; the
finite-``m`` kernel estimate is ``URK(x, x') = s(x)^T s(x') / m``, an unbiased estimate of
``k(x, x') = E_omega[z_omega(x)^T z_omega(x')]`` (FedBNR paper, Eqs. 14-17; we divide by ``m``,
which is what makes the estimate unbiased, where the paper's Eq. 17 writes ``m - 1``).

The URK here has the FedBNR architecture (paper App. A.2, Fig. A.1 right):

    z_omega(x) = [cos(h(omega)^T f(x)), sin(h(omega)^T f(x))],   omega ~ base distribution,

with ``f`` a small neural feature map of the input and ``h`` a "distribution shifter" of the base
draws: ``h(omega) = omega / lengthscale + MLP(omega)``, so that ``f = identity`` and a zero MLP give
exactly random Fourier features of an ARD kernel, SE for Gaussian base draws and Matérn-nu for
Student-t base draws with ``2 nu`` degrees of freedom (Bochner's theorem). The base draws are
fixed once (:func:`base_draws`); all weights live in one pytree, :class:`URKParams` (the networks
are :class:`fedppl.models.networks.MLP`), so they can be optimised, averaged (FedAvg) or registered
as NumPyro params (:func:`urk_param`).

Example::

    >>> import jax
    >>> spec = URKSpec(input_dim=4, feature_widths=(32, 8), num_samples=50)
    >>> params = init_urk(jax.random.key(0), spec)
    >>> omega = base_draws(jax.random.key(1), spec)
    >>> X = jax.random.normal(jax.random.key(2), (10, 4))
    >>> Phi = urk_features(params, omega, X)          # (n, 2 * 50)
    >>> Phi.shape
    (10, 100)
    >>> K_hat = Phi @ Phi.T                           # URK Gram matrix
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array
from numpyro.distributions import constraints

from fedppl.models.networks import MLP

__all__ = ["URKSpec", "URKParams", "check_spec", "init_urk", "base_draws", "urk_features",
           "rff_features",
           "urk_param", "feature_regression", "urk_regression"]

class URKSpec(NamedTuple):
    """Architecture of a URK.

    ``feature_widths=()`` makes ``f`` the identity (then the kernel is stationary);
    ``shift_widths=()`` drops the shifter's MLP (pure random Fourier features).
    ``spectral`` picks the base draws: ``"se"`` (Gaussian) or ``"matern12"``/``"matern32"``/
    ``"matern52"`` (Student-t).
    """

    input_dim: int
    feature_widths: tuple[int, ...] = (50, 50, 5)
    shift_widths: tuple[int, ...] = (16,)
    num_samples: int = 50
    spectral: str = "se"

    @property
    def omega_dim(self) -> int:
        return self.feature_widths[-1] if self.feature_widths else self.input_dim

    @property
    def num_features(self) -> int:
        return 2 * self.num_samples


class URKParams(NamedTuple):
    """The URK's weights: every leaf an array (a pytree to optimise, average or register)."""

    feature: MLP  # x -> R^omega_dim (no layers: the identity)
    shift: MLP | None  # omega -> R^omega_dim, added to omega / lengthscale (None: no shifter)
    log_lengthscale: Array  # (omega_dim,)


_NU = {"matern12": 0.5, "matern32": 1.5, "matern52": 2.5}
SPECTRAL = ("se", *_NU)


def _positive_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def check_spec(spec: URKSpec) -> URKSpec:
    """A clear error for a malformed architecture (before any weights are drawn)."""
    if not isinstance(spec, URKSpec):
        raise TypeError(f"spec must be a URKSpec, got {type(spec).__name__}")
    if not _positive_int(spec.input_dim):
        raise ValueError(f"URKSpec.input_dim must be a positive integer, got {spec.input_dim!r}")
    for name in ("feature_widths", "shift_widths"):
        widths = getattr(spec, name)
        if not isinstance(widths, tuple) or not all(_positive_int(w) for w in widths):
            raise ValueError(f"URKSpec.{name} must be a tuple of positive integers, got "
                             f"{widths!r}")
    if not _positive_int(spec.num_samples):
        raise ValueError(f"URKSpec.num_samples must be a positive integer, got "
                         f"{spec.num_samples!r}")
    if spec.spectral not in SPECTRAL:
        raise ValueError(f"spectral must be one of {SPECTRAL}, got {spec.spectral!r}")
    return spec


def init_urk(key: Array, spec: URKSpec, lengthscale: float = 1.0) -> URKParams:
    """Glorot-initialised weights; the shifter's MLP starts at zero output (pure RFF)."""
    check_spec(spec)
    k1, k2 = jax.random.split(key)
    feature = MLP((spec.input_dim, *spec.feature_widths), key=k1)
    d = spec.omega_dim
    shift = (MLP((d, *spec.shift_widths, d), key=k2, final_scale=0.0) if spec.shift_widths
             else None)
    return URKParams(feature, shift, jnp.full(d, jnp.log(lengthscale)))


def base_draws(key: Array, spec: URKSpec) -> Array:
    """The fixed random draws ``omega`` of shape ``(num_samples, omega_dim)``, in JAX's default
    float. Drawn in float32 whatever the dtype, so that a float32 and a float64 run from one key
    share their features (and differ only by rounding)."""
    check_spec(spec)
    k1, k2 = jax.random.split(key)
    dtype = jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32
    z = jax.random.normal(k1, (spec.num_samples, spec.omega_dim), jnp.float32).astype(dtype)
    if spec.spectral == "se":
        return z
    nu = _NU[spec.spectral]
    u = 2.0 * jax.random.gamma(k2, nu, (spec.num_samples, 1), jnp.float32).astype(dtype)
    return z * jnp.sqrt(2.0 * nu / u)  # u: chi-square with 2 nu dof


def rff_features(omega: Array, X: Array, lengthscale: Array | float = 1.0) -> Array:
    """Random Fourier features ``[cos(X W^T), sin(X W^T)] / sqrt(m)``,
    ``W = omega / lengthscale``."""
    proj = X @ (omega / lengthscale).T
    return jnp.concatenate([jnp.cos(proj), jnp.sin(proj)], axis=-1) / jnp.sqrt(omega.shape[0])


def urk_features(params: URKParams, omega: Array, X: Array) -> Array:
    """URK features ``(n, 2 m)`` of inputs ``X (n, input_dim)``; ``Phi @ Phi.T`` is the URK."""
    fx = params.feature(X)
    freq = omega * jnp.exp(-params.log_lengthscale)
    if params.shift is not None:
        freq = freq + params.shift(omega)
    return rff_features(freq, fx)


def urk_param(name: str, params: URKParams) -> URKParams:
    """Register every weight of ``params`` as a NumPyro param (``name/feature/layers/0/weight``,
    ...) and return the (possibly substituted) values, so a NumPyro model can learn the kernel."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    values = []
    for path, leaf in leaves:
        key = "/".join(str(getattr(p, "name", getattr(p, "idx", p))) for p in path)
        values.append(numpyro.param(f"{name}/{key}", leaf))
    return jax.tree_util.tree_unflatten(treedef, values)


def feature_regression(Phi: Array, y: Array | None = None, noise: Array | float = 1.0,
                       prior_scale: Array | float = 1.0) -> None:
    """Bayesian linear regression on features: ``w ~ N(0, prior_scale^2 I)``,
    ``y ~ N(Phi w, noise^2)``; the FedBNR last layer as a NumPyro model."""
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([Phi.shape[1]]).to_event(1))
    with numpyro.plate("data", Phi.shape[0]):
        numpyro.sample("y", dist.Normal(Phi @ w, noise), obs=y)


def urk_regression(X: Array, y: Array | None = None, *, omega: Array, init: URKParams,
                   noise: float = 0.3, prior_scale: float = 1.0) -> None:
    """A random-feature GP as a NumPyro model: the URK weights, the noise and the prior scale
    are NumPyro params (learnable with SVI or type-II maximum likelihood), ``w`` is latent."""
    kernel = urk_param("urk", init)
    sigma = numpyro.param("noise", jnp.asarray(noise), constraint=constraints.positive)
    lam = numpyro.param("prior_scale", jnp.asarray(prior_scale), constraint=constraints.positive)
    feature_regression(urk_features(kernel, omega, X), y, sigma, lam)
