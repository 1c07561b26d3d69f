"""Differential privacy of released GP posterior means (thesis Sec. 1.4 and 4.4).

The mechanism (Hall, Rinaldo and Wasserman 2013; applied to GPs by Smith et al. 2016) releases
the posterior mean of a GP trained on private labels ``y`` (public inputs ``X``) as

    m~(x*) = mu_D(x*) + (Delta * c(delta) / epsilon) * g(x*),   g ~ GP(0, k),

where ``mu_D(x*) = k(x*, X)(K + s^2 I)^-1 y`` and ``Delta`` bounds, in the RKHS norm of ``k``,
how far ``mu_D`` moves when one label changes by at most ``d``. Posterior variances do not
depend on ``y`` and are released unchanged. The pieces are explicit here:

* :func:`c_delta` -- the multiplier ``c(delta)`` (Hall et al.'s rule by default; the thesis's rule
  as an option, with the thesis's inconsistency documented there);
* :func:`gp_mean_sensitivity` -- ``Delta`` (Smith et al.'s bound, or the exact RKHS value);
* :func:`release_mean` -- one release, returning a :class:`DPRelease`;
* :class:`PriorSamplePath` -- one prior draw ``g`` evaluated consistently at any points, for
  releases that reuse one sample path;
* :class:`PrivacyAccountant` -- the composed ``(epsilon, delta)`` of repeated releases, computed
  with ``dp_accounting`` (privacy-loss distributions by default).

Repeated releases. With a FRESH prior sample per release (the default), release ``i`` is a
Gaussian mechanism with noise multiplier ``sigma_i = c(delta_i) / epsilon_i`` (noise standard
deviation over sensitivity, measured in the RKHS of ``k``) and the privacy losses compose: record
every release in a :class:`PrivacyAccountant` and read the total from it. With ONE sample path
reused for every release (``PrivacyAccountant(reuse_sample_path=True)`` and ``prior_sample=``
from a :class:`PriorSamplePath`), everything released is an evaluation of the single random
function ``mu_D + scale * g``, which is one mechanism; later releases are post-processing and
cost nothing more. That argument needs every release to evaluate the SAME function ``mu_D``:
same training inputs and labels, same hyperparameters and noise variance, same ``Delta`` and
multiplier. If the model is refitted or its data change between releases, the released values
are evaluations of different functions with correlated noise, and the one-mechanism argument
fails; use fresh samples and composition then. Neither policy covers hyperparameters chosen by
type-II maximum likelihood on the private labels (as the thesis does): that choice itself
depends on ``y`` and is not protected by this mechanism.

Randomness is drawn with numpy (``np.random.default_rng``); a JAX PRNG key is accepted and
turned into a numpy seed from its raw key data.

Example::

    >>> import numpy as np
    >>> from fedppl import privacy
    >>> x = np.linspace(0, 1, 5)
    >>> K_train = np.exp(-0.5 * (x[:, None] - x[None]) ** 2 / 0.3**2)
    >>> sens = privacy.gp_mean_sensitivity(K_train, noise_var=0.1, d=1.0)
    >>> acc = privacy.PrivacyAccountant()                       # fresh sample per release
    >>> out = privacy.release_mean(0, np.zeros(3), K_train[:3, :3], sens, epsilon=1.0,
    ...                            delta=1e-2, accountant=acc)
    >>> out.mean.shape, bool(out.noise_scale > 0)               # released values, Delta c / eps
    ((3,), True)
    >>> acc.count, bool(acc.epsilon(target_delta=1e-5) > 1.0)   # composed cost so far
    (1, True)
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from scipy import linalg

if TYPE_CHECKING:  # dp_accounting loads scipy.signal and scipy.stats (~0.8 s): imported on use
    import dp_accounting

__all__ = [
    "RULES",
    "DPRelease",
    "c_delta",
    "gp_mean_sensitivity",
    "release_mean",
    "PriorSamplePath",
    "PrivacyAccountant",
]

#: The rules for the constant ``c(delta)`` of the Gaussian mechanism (see :func:`c_delta`).
RULES = ("hall", "thesis")


class DPRelease(NamedTuple):
    """A released mean, the scale ``Delta c(delta) / epsilon`` of the added prior sample, and
    the nominal one-shot ``(epsilon, delta)`` of this release."""

    mean: np.ndarray
    noise_scale: float
    epsilon: float
    delta: float


# ---------------------------------------------------------------------------------------------
# validation helpers

def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 < delta < 1.0:  # also rejects NaN
        raise ValueError(f"delta must lie in (0, 1), got delta={delta}")
    return delta


def _check_epsilon(epsilon: float) -> float:
    epsilon = float(epsilon)
    if not (epsilon > 0.0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be positive and finite, got epsilon={epsilon}")
    return epsilon


def _square(A: Any, name: str) -> np.ndarray:
    A = np.asarray(A, dtype=float)
    if A.ndim != 2 or A.shape[0] != A.shape[1] or A.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty square matrix, got shape {A.shape}")
    if not np.all(np.isfinite(A)):
        raise ValueError(f"{name} has non-finite entries")
    if not np.allclose(A, A.T, rtol=1e-8, atol=1e-10 * max(1.0, np.abs(A).max())):
        raise ValueError(f"{name} is not symmetric")
    return 0.5 * (A + A.T)


# ---------------------------------------------------------------------------------------------
# the mechanism

def c_delta(delta: float, rule: str = "hall") -> float:
    """The multiplier ``c(delta)`` of the GP-prior-sample mechanism.

    ``"hall"`` (default): ``sqrt(2 log(2 / delta))``, from Hall, Rinaldo and Wasserman (2013),
    as used by the reference implementation of Smith et al. (2016); the analysis assumes
    ``epsilon <= 1``.

    ``"thesis"``: ``sqrt(2 log(1.25 / delta))``, the bound written in thesis Sec. 1.4 (the
    classical Gaussian-mechanism constant of Dwork and Roth, also derived for ``epsilon < 1``).
    The thesis is inconsistent with itself: Sec. 4.4 quotes a "scaling factor of 0.42" for
    ``epsilon = 1, delta = 0.00625, Delta = 1``, but its formula gives
    ``sqrt(2 log 200) = 3.255`` there (and the Hall rule gives ``sqrt(2 log 320) = 3.396``), so
    0.42 matches neither. This option implements the formula, not the quoted number.
    """
    delta = _check_delta(delta)
    if rule == "hall":
        return math.sqrt(2.0 * math.log(2.0 / delta))
    if rule == "thesis":
        return math.sqrt(2.0 * math.log(1.25 / delta))
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def gp_mean_sensitivity(K_train: Any, noise_var: float, d: float, *,
                        method: str = "smith") -> float:
    """Sensitivity ``Delta`` of the GP posterior mean to one label changing by at most ``d``.

    The released mean at points ``x*`` is ``k(x*, X)(K + s^2 I)^-1 y``: a function in the RKHS
    of ``k`` with weights ``alpha = (K + s^2 I)^-1 y``. Changing label ``j`` by ``d`` moves the
    weights by ``d`` times column ``j`` of ``C = (K + s^2 I)^-1``, so the change of the mean lies
    in the RKHS and the GP-prior-sample mechanism with this ``Delta`` applies.

    ``"smith"`` (default): Smith et al.'s bound ``d * max_i sum_j |C_ij|`` (the largest absolute
    row sum of ``C``). It relies on ``|k(x, x')| <= 1``; a warning is raised when the diagonal
    of ``K_train`` exceeds 1. ``"rkhs"``: the exact largest RKHS norm of the change,
    ``d * max_j sqrt((C K C)_jj)``, valid for any kernel scale and never above the Smith bound
    for kernels bounded by 1.

    ``C`` is computed by a Cholesky solve of ``K + s^2 I``, which must be positive definite.
    """
    d = float(d)
    if not (d > 0.0 and math.isfinite(d)):
        raise ValueError(f"d (largest change of one label) must be positive, got d={d}")
    noise_var = float(noise_var)
    if not (noise_var >= 0.0 and math.isfinite(noise_var)):
        raise ValueError(f"noise_var must be non-negative, got noise_var={noise_var}")
    if method not in ("smith", "rkhs"):
        raise ValueError(f"method must be 'smith' or 'rkhs', got {method!r}")
    K = _square(K_train, "K_train")
    A = K + noise_var * np.eye(K.shape[0])
    try:
        factor = linalg.cho_factor(A, lower=True)
    except linalg.LinAlgError:
        raise ValueError("K_train + noise_var * I is not positive definite "
                         f"(smallest eigenvalue {np.linalg.eigvalsh(A)[0]:.3g})") from None
    C = linalg.cho_solve(factor, np.eye(K.shape[0]))
    C = 0.5 * (C + C.T)
    if method == "rkhs":
        norms2 = np.einsum("ij,ij->j", C, K @ C)
        return d * float(np.sqrt(np.max(np.clip(norms2, 0.0, None))))
    if np.max(np.diag(K)) > 1.0 + 1e-9:
        warnings.warn(f"Smith et al.'s bound assumes |k(x, x')| <= 1, but K_train has diagonal "
                      f"up to {np.max(np.diag(K)):.4g}; the value may not bound the change. "
                      "Use method='rkhs' or a kernel scaled to variance <= 1.",
                      RuntimeWarning, stacklevel=2)
    return d * float(np.max(np.sum(np.abs(C), axis=1)))


def _numpy_rng(rng: Any) -> np.random.Generator:
    """A numpy Generator from a seed, a Generator, or a JAX PRNG key."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, (int, np.integer)):
        return np.random.default_rng(rng)
    try:
        import jax
    except ImportError:  # pragma: no cover - jax is a dependency
        jax = None
    if jax is not None and isinstance(rng, jax.Array):
        if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)
        return np.random.default_rng(np.asarray(rng, dtype=np.uint64).ravel().tolist())
    raise TypeError(f"expected an int seed, a numpy Generator or a JAX key, got {type(rng)}")


def _cholesky_psd(S: np.ndarray) -> np.ndarray:
    """Lower Cholesky factor of a PSD matrix, adding a small relative jitter if needed."""
    scale = max(float(np.mean(np.diag(S))), np.finfo(float).tiny)
    for jitter in (0.0, 1e-12, 1e-10, 1e-8, 1e-6):
        try:
            return np.linalg.cholesky(S + jitter * scale * np.eye(S.shape[0]))
        except np.linalg.LinAlgError:
            continue
    raise ValueError("prior_cov is not positive semi-definite (Cholesky failed with jitter "
                     f"up to 1e-6 times its mean diagonal; smallest eigenvalue "
                     f"{np.linalg.eigvalsh(S)[0]:.3g})")


def release_mean(rng_key_or_seed: Any, mean: Any, prior_cov: Any | None, sensitivity: float,
                 epsilon: float, delta: float, rule: str = "hall", *,
                 prior_sample: Any | None = None,
                 accountant: PrivacyAccountant | None = None) -> DPRelease:
    """Release ``mean + (sensitivity * c(delta) / epsilon) * g`` with ``g ~ N(0, prior_cov)``.

    ``mean`` has shape ``(..., n)`` (leading axes get independent draws) and ``prior_cov`` is
    the GP prior kernel on the ``n`` released points (a tiny jitter is added only if its
    Cholesky fails). Pass ``prior_sample`` (shape broadcastable to ``mean``) to use a given
    prior draw instead, e.g. ``PriorSamplePath(kernel)(X_star)`` when one path is reused;
    ``prior_cov`` and the rng are then unused. Randomness is drawn with numpy from an int seed,
    a ``np.random.Generator`` or a JAX key. With ``accountant`` the release is recorded there
    (its reuse policy must agree with whether ``prior_sample`` is given).

    The Hall et al. analysis (and the thesis rule's) assumes ``epsilon <= 1``; larger values
    raise a :class:`RuntimeWarning`. Use a :class:`PrivacyAccountant` for the exact cost.
    """
    epsilon = _check_epsilon(epsilon)
    c = c_delta(delta, rule)
    delta = float(delta)
    sensitivity = float(sensitivity)
    if not (sensitivity >= 0.0 and math.isfinite(sensitivity)):
        raise ValueError(f"sensitivity must be non-negative, got sensitivity={sensitivity}")
    if epsilon > 1.0:
        warnings.warn(f"epsilon={epsilon} > 1: the (epsilon, delta) guarantee of the GP-sample "
                      "mechanism is derived for epsilon <= 1; use a PrivacyAccountant for the "
                      "actual cost", RuntimeWarning, stacklevel=2)
    mean = np.asarray(mean, dtype=float)
    if mean.ndim == 0:
        raise ValueError("mean must have at least one dimension (the released points)")
    scale = sensitivity * c / epsilon
    if accountant is not None and accountant.reuse_sample_path and prior_sample is None:
        raise ValueError("the accountant reuses one sample path: pass prior_sample= from that "
                         "path (PriorSamplePath), not a fresh draw")
    if prior_sample is not None:
        g = np.broadcast_to(np.asarray(prior_sample, dtype=float), mean.shape)
    else:
        if prior_cov is None:
            raise ValueError("prior_cov is required unless prior_sample is given")
        S = _square(prior_cov, "prior_cov")
        if S.shape[0] != mean.shape[-1]:
            raise ValueError(f"prior_cov is {S.shape} but mean has {mean.shape[-1]} points")
        L = _cholesky_psd(S)
        z = _numpy_rng(rng_key_or_seed).standard_normal(mean.shape)
        g = z @ L.T
    if accountant is not None:
        accountant.record(c / epsilon)
    return DPRelease(mean + scale * g, float(scale), epsilon, delta)


class PriorSamplePath:
    """One draw ``g ~ GP(0, kernel)``, evaluated lazily and consistently at any points.

    Each call samples ``g`` at the new points conditionally on all values drawn before, so
    repeated and overlapping queries see one function. ``kernel(A, B)`` returns the prior
    covariance matrix between rows of ``A`` and ``B``.
    """

    def __init__(self, kernel: Callable[[Any, Any], Any], rng_key_or_seed: Any = None,
                 jitter: float = 1e-10) -> None:
        self.kernel = kernel
        self.jitter = float(jitter)
        self._rng = _numpy_rng(rng_key_or_seed)
        self._X: np.ndarray | None = None
        self._g = np.zeros(0)

    def _k(self, A: np.ndarray, B: np.ndarray) -> np.ndarray:
        return np.asarray(self.kernel(A, B), dtype=float)

    def __call__(self, X: Any) -> np.ndarray:
        """Values of the path at the rows of ``X`` (shape ``(n, ...)``)."""
        X = np.asarray(X, dtype=float)
        if X.ndim == 0 or len(X) == 0:
            raise ValueError(f"X must hold at least one point along axis 0, got shape {X.shape}")
        Kxx = self._k(X, X)
        if self._X is None:
            mu, cov = np.zeros(len(X)), Kxx
        else:
            Kss = self._k(self._X, self._X)
            Ksx = self._k(self._X, X)
            jit = self.jitter * max(float(np.mean(np.diag(Kss))), 1.0)
            factor = linalg.cho_factor(Kss + jit * np.eye(len(Kss)), lower=True)
            mu = Ksx.T @ linalg.cho_solve(factor, self._g)
            cov = Kxx - Ksx.T @ linalg.cho_solve(factor, Ksx)
        w, V = np.linalg.eigh(0.5 * (cov + cov.T))  # PSD square root: cov may be ~singular
        g = mu + V @ (np.sqrt(np.clip(w, 0.0, None)) * self._rng.standard_normal(len(X)))
        self._X = X if self._X is None else np.concatenate([self._X, X])
        self._g = np.concatenate([self._g, g])
        return g


# ---------------------------------------------------------------------------------------------
# accounting

class PrivacyAccountant:
    """Composed ``(epsilon, delta)`` of repeated GP-sample releases, via ``dp_accounting``.

    Each release is a Gaussian mechanism in the RKHS with noise multiplier
    ``sigma = c(delta) / epsilon`` (noise standard deviation over sensitivity); record it with
    :meth:`record`. ``Delta`` already is the full distance between the outputs on neighbouring
    data (one label replaced by one within ``d``), so each release's privacy loss is that of
    ``N(0, sigma^2)`` against ``N(1, sigma^2)``: dp_accounting's ``ADD_OR_REMOVE_ONE`` relation
    for a ``GaussianDpEvent`` (its ``REPLACE_ONE`` would double the sensitivity).

    ``reuse_sample_path=False`` (default): every release uses a fresh prior sample and the
    losses compose. ``True``: every release evaluates one function with one sample path, which
    is one mechanism, so any number of releases costs one; all must share one multiplier.

    ``method="pld"`` (privacy-loss distributions, tight; default) or ``"rdp"`` (Renyi DP,
    looser). The accountant's epsilon for one release is the exact cost of that Gaussian
    mechanism, usually well below the nominal epsilon of the Hall et al. calibration.
    """

    def __init__(self, *, reuse_sample_path: bool = False, method: str = "pld",
                 value_discretization_interval: float = 1e-3) -> None:
        if method not in ("pld", "rdp"):
            raise ValueError(f"method must be 'pld' or 'rdp', got {method!r}")
        self.reuse_sample_path = bool(reuse_sample_path)
        self.method = method
        self.value_discretization_interval = float(value_discretization_interval)
        self._multipliers: list[float] = []

    def record(self, noise_multiplier: float) -> None:
        """Record one release with noise multiplier ``sigma = noise std / sensitivity``."""
        sigma = float(noise_multiplier)
        if not sigma > 0.0:  # also rejects NaN; inf (no information released) is allowed
            raise ValueError(f"noise_multiplier must be positive, got {noise_multiplier}")
        if self.reuse_sample_path and self._multipliers and not math.isclose(
                sigma, self._multipliers[0], rel_tol=1e-9):
            raise ValueError(f"a reused sample path is one mechanism with one multiplier: "
                             f"got {sigma} after {self._multipliers[0]}")
        self._multipliers.append(sigma)

    @property
    def count(self) -> int:
        """Number of releases recorded."""
        return len(self._multipliers)

    @property
    def num_mechanisms(self) -> int:
        """Number of mechanisms that compose (1 at most when the sample path is reused)."""
        return min(self.count, 1) if self.reuse_sample_path else self.count

    @property
    def noise_multipliers(self) -> tuple[float, ...]:
        return tuple(self._multipliers)

    def dp_event(self) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event describing everything released so far."""
        import dp_accounting

        sigmas = [s for s in self._multipliers if math.isfinite(s)]
        if not sigmas:
            return dp_accounting.NoOpDpEvent()
        if self.reuse_sample_path:
            return dp_accounting.GaussianDpEvent(sigmas[0])
        return dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(s), n)
            for s, n in sorted(Counter(sigmas).items())])

    def epsilon(self, target_delta: float) -> float:
        """Composed epsilon of all releases so far at ``target_delta`` (0 with none)."""
        from fedppl import accounting

        return accounting.epsilon(self.dp_event(), _check_delta(target_delta), self.method,
                                  value_discretization_interval=self.value_discretization_interval)

    def __repr__(self) -> str:
        return (f"PrivacyAccountant(count={self.count}, reuse_sample_path="
                f"{self.reuse_sample_path}, method={self.method!r})")
