"""Float32 runs of the core, with tolerances derived from the dtype.

How the tests get float32 in a suite that runs in float64 (``tests/conftest.py`` turns
``jax_enable_x64`` on for the whole process):

* **x64 off** (fixture ``no_x64``; ``test_gaussian_float32.py``, ``test_handlers_float32.py``,
  ``test_pvi_float32.py``): the test runs inside ``jax.enable_x64(False)``, JAX's own context
  manager for the flag. Under it JAX computes as in a float32-only process: ``jnp`` defaults,
  ``jax.random`` draws, numpyro's internals and JAX's default float (what ``PVIGuide`` uses when
  given no dtype) are float32, and jit caches are keyed on the flag, so nothing compiled in
  float64 is reused. The flag is thread-local config state, restored when the test leaves the
  context (also on failure), so it cannot leak into the next test; under
  ``pytest -n 2 --dist loadfile`` each xdist worker is its own process that runs its tests one
  after another on one thread, so the context is as safe there as without xdist. A subprocess
  with ``JAX_ENABLE_X64=0`` would do too, at a few seconds of imports and recompilation per run;
  this conftest cannot switch x64 off for its directory, because the root conftest has switched
  it on for the whole process. Every array a test compares must be made inside the context:
  the data fixtures of those modules request ``no_x64`` themselves, so they are set up inside it.
* **x64 on, float32 asked for** (no fixture; ``test_no_upcast.py``, ``test_no_upcast_pvi.py``):
  the suite's own mode, with float32 inputs and ``PVIGuide(..., dtype=jnp.float32)``. Here a
  stray float64 constant (``np.eye``, ``jnp.zeros(n)`` without a dtype, a NumPy statistic)
  *does* promote a float32 result to float64, so these are the tests that catch silent upcasts;
  with x64 off nothing can be float64.

Tolerances follow tinygp's tests: ``100 eps`` of the dtype (:func:`rtol`), times the condition
number of the matrix the result comes out of (a backward-stable solve with a matrix of condition
number ``k`` loses up to ``k eps`` relative). A sum is held to that relative to the sum of the
absolute values of its terms (what its rounding is relative to), not to its value. The same
bounds in float64 are ~1e-13, what the float64 tests ask for; in float32 they are 1e-5 to 1e-3
(the observed errors are 10 to 1000 times smaller: the bounds are worst cases).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

F32 = jnp.float32


def eps(dtype=F32) -> float:
    return float(jnp.finfo(dtype).eps)


def rtol(dtype=F32, cond: float = 1.0, factor: float = 100.0) -> float:
    """``factor * eps * cond``: the relative error a backward-stable computation with a matrix
    of condition number ``cond`` may leave, with a margin of ``factor`` over one rounding."""
    return factor * eps(dtype) * cond


def cond(a) -> float:
    return float(np.linalg.cond(np.asarray(a, np.float64)))


def f64(tree):
    """The same pytree as NumPy float64 arrays (a reference computed from the rounded inputs)."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


def assert_dtype(tree, dtype=F32, what: str = ""):
    """Every floating leaf of ``tree`` has ``dtype`` (no silent upcast)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    bad = [(jax.tree_util.keystr(p), str(x.dtype)) for p, x in leaves
           if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype]
    assert not bad, f"{what}: not {jnp.dtype(dtype).name}: {bad}"


@pytest.fixture
def no_x64():
    """Run the test with x64 off: float32 throughout (see module doc)."""
    with jax.enable_x64(False):
        yield


@pytest.fixture
def data32():
    """Float32 regression data: ``X``, a linear response and binary labels."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3)).astype(np.float32)
    y_lin = (X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=60)).astype(np.float32)
    y_bin = (rng.uniform(size=60) < 1 / (1 + np.exp(-X @ np.array([1.5, -1.0, 0.5])))
             ).astype(np.float32)
    return X, y_lin, y_bin
