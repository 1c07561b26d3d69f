"""The one validation layer every front shares: clear errors before any compiled code runs.

Each check names the argument (or the client) and the problem, and returns the value in the
form the code wants. The clients' data are checked when a :class:`~fedppl.clients.Clients` is
built (shapes, empty clients, NaN or infinite values); the checks here cover the settings and
what depends on the model (labels in the likelihood's support, input dimensions).

Example::

    >>> positive_int(3, "num_rounds")
    3
    >>> positive_int(2.5, "num_clients")
    Traceback (most recent call last):
    ...
    TypeError: num_clients must be a positive integer, got 2.5
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedppl.model_call import READS_VALUES

__all__ = ["pvi_settings", "positive_int", "positive", "fraction", "one_of", "optimizer", "rng_key",
           "labels_in", "inputs_2d", "indices_in_range", "warn"]


def positive_int(value: Any, name: str, minimum: int = 1) -> int:
    """A whole number ``>= minimum`` (rejects 2.5, "3", True and NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    return int(value)


def positive(value: Any, name: str, allow_zero: bool = False) -> float:
    """A finite real number ``> 0`` (or ``>= 0``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    ok = value >= 0 if allow_zero else value > 0
    if not (np.isfinite(value) and ok):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'} and "
                         f"finite, got {value}")
    return float(value)


def fraction(value: Any, name: str) -> float:
    """A number in (0, 1]."""
    value = positive(value, name)
    if value > 1:
        raise ValueError(f"{name} must be in (0, 1], got {value}")
    return value


def one_of(value: Any, allowed: Sequence[Any], name: str) -> Any:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def optimizer(value: Any, name: str = "optimizer") -> Any:
    """An optax optimiser (a ``GradientTransformation``), not a string or a learning rate."""
    if not (hasattr(value, "init") and hasattr(value, "update")):
        raise TypeError(f"{name} must be an optax optimiser such as optax.adam(1e-2), got "
                        f"{value!r}")
    return value


def rng_key(value: Any, name: str = "rng_key") -> Any:
    """A JAX key (``jax.random.key(0)`` or ``jax.random.PRNGKey(0)``), never an integer seed."""
    if value is None or isinstance(value, (int, np.integer, float)):
        raise TypeError(f"{name} must be a JAX key such as jax.random.key(0), got {value!r}")
    try:
        dtype = jnp.asarray(value).dtype if not hasattr(value, "dtype") else value.dtype
    except TypeError as err:
        raise TypeError(f"{name} must be a JAX key, got {type(value).__name__}") from err
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return value
    if np.shape(value) != (2,) or dtype != jnp.uint32:
        raise TypeError(f"{name} must be a JAX key such as jax.random.key(0), got an array of "
                        f"shape {np.shape(value)} and dtype {dtype}")
    return value


def labels_in(y: Any, support: Sequence[float], who: str, name: str = "labels") -> None:
    """Every label is one of ``support`` (Bernoulli: 0 or 1)."""
    arr = np.asarray(y)
    if not np.issubdtype(arr.dtype, np.number) and arr.dtype != bool:
        raise TypeError(f"{who}: {name} must be numbers in {tuple(support)}, got dtype "
                        f"{arr.dtype}")
    bad = ~np.isin(arr, np.asarray(support))
    if bad.any():
        raise ValueError(f"{who}: {name} must be in {tuple(support)}; found "
                         f"{np.unique(arr[bad])[:5].tolist()}")


def inputs_2d(X: Any, who: str, dim: int | None = None, name: str = "X") -> None:
    """Inputs of shape (N, D), with ``D == dim`` when given."""
    shape = np.shape(X)
    if len(shape) != 2:
        hint = f": use {name}[:, None] for one feature" if len(shape) == 1 else ""
        raise ValueError(f"{who}: {name} must have shape (N, D), got {shape}{hint}")
    if dim is not None and shape[1] != dim:
        raise ValueError(f"{who}: {name} has {shape[1]} features where {dim} are expected")


def pvi_settings(damping: float, conjugate: Any, solver: str, solvers: Sequence[str],
                 local_steps: int | None, num_particles: int | None, local_tol: float | None,
                 shrink_warning: float, max_divergence: float) -> None:
    """Refuse PVI settings that cannot work, with one message for each (the NumPyro core's
    :class:`fedppl.PVI` and the Pyro port's :class:`fedppl.pyro.PVI` share them)."""
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"damping must be in (0, 1], got {damping}")
    if conjugate not in ("auto", True, False, "polya-gamma"):
        raise ValueError("conjugate must be 'auto', True, False or 'polya-gamma', got "
                         f"{conjugate!r}")
    if solver not in solvers:
        raise ValueError(f"solver must be one of {tuple(solvers)}, got {solver!r}")
    if local_steps is not None and local_steps < 1:
        raise ValueError(f"local_steps (the local step's cap) must be >= 1, got {local_steps}")
    if num_particles is not None and num_particles < 1:
        raise ValueError(f"num_particles must be positive, got {num_particles}")
    if solver == "natural-gradient" and num_particles is not None and num_particles % 2:
        raise ValueError("the natural-gradient solver uses antithetic pairs of draws: "
                         f"num_particles must be even, got {num_particles}")
    if local_tol is not None and not local_tol > 0:
        raise ValueError(f"local_tol must be positive, got {local_tol}")
    if not shrink_warning > 1:
        raise ValueError(f"shrink_warning must be a factor > 1, got {shrink_warning}")
    if not max_divergence > 0:  # also refuses NaN
        raise ValueError(f"max_divergence must be positive (nats per dimension), got "
                         f"{max_divergence}")


def indices_in_range(model: Any, data: tuple, model_kwargs: dict, trace: dict, who: str) -> None:
    """A ``ValueError`` naming ``who``, the array and its plate when the model, run on ``data``
    at the latent values of ``trace`` (a trace of it on the same data), indexes an array out of
    range (``a[g]`` with a group id at or past ``a``'s plate size). JAX clamps such an index
    silently, merging the last group with the ones past it; the check runs the model's log
    density once under ``jax.experimental.checkify``'s index checks, as one compiled program
    (op by op, a model of a hundred operations compiled a hundred small programs for each new
    data shape, about a second); a model that needs its data's values while tracing (a group
    count read from the data) runs op by op. Data without integer arrays cannot index, and are
    not run."""
    from jax.experimental import checkify
    from numpyro.infer.util import log_density

    if not any(jnp.issubdtype(jnp.result_type(a), jnp.integer) for a in data):
        return
    latent = {name: site["value"] for name, site in trace.items()
              if site["type"] == "sample" and not site["is_observed"]}

    def density(values, arrays):
        return log_density(model, arrays, model_kwargs, values)[0]

    checked = checkify.checkify(density, errors=checkify.index_checks)
    try:
        err, _ = jax.jit(checked)(latent, tuple(data))
    except READS_VALUES:
        err, _ = checked(latent, tuple(data))
    bad = err.get_exception()
    if bad is None:
        return
    shape = tuple(getattr(bad, "operand_shape", ()))
    sites = [f"'{name}'" + "".join(f" in plate '{f.name}' of size {f.size}"
                                   for f in site["cond_indep_stack"])
             for name, site in trace.items() if site["type"] == "sample"
             and not site["is_observed"] and tuple(jnp.shape(site["value"])) == shape]
    of = f" (the latent site {' or '.join(sites)})" if sites else ""
    raise ValueError(
        f"{who}: the model indexes an array out of range{of}: {str(err.get()).strip()} JAX "
        "would clamp the index silently, merging groups; number groups from 0 to the plate's "
        "size minus one, and give the plate the largest size over clients (a static keyword "
        "argument such as n_groups)")


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` located at the caller's first line outside fedppl (the user's line that
    started the run, rather than the line inside fedppl that noticed; Python 3.11 has no
    ``skip_file_prefixes``)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
