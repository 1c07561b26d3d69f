"""Where the Pyro port meets the core: torch tensors to JAX arrays and back, and torch functions
called from JAX.

The core (:mod:`fedppl.algorithms`, :mod:`fedppl.runtime`) runs in JAX, compiled; a Pyro model
runs in torch. :func:`host` calls a torch function from JAX code through ``jax.pure_callback``:
under ``jax.vmap`` (clients, draws, candidates) the callback is called once for the whole batch,
and the torch side maps the function over it with ``torch.func.vmap``, one level per batch axis,
so a round still runs the model's Python code once per evaluation, not once per client.
:func:`differentiable` makes such a function a scalar JAX function whose ``jax.grad`` and
``jax.hessian`` call torch's gradient and Hessian (``jax.custom_jvp``), which is all the core's
natural-gradient step, its ELBO and its prior solver ask of a log density.

Example::

    >>> import jax, jax.numpy as jnp, torch
    >>> f = differentiable(lambda x: (x**3).sum())
    >>> x = jnp.array([1.0, 2.0])
    >>> float(f(x)), jax.grad(f)(x).tolist(), jax.hessian(f)(x).tolist()
    (9.0, [3.0, 12.0], [[6.0, 0.0], [0.0, 12.0]])
    >>> jax.jit(jax.vmap(f))(jnp.ones((4, 2))).shape      # one callback for the batch
    (4,)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyro
import torch

__all__ = ["to_jax", "to_torch", "jax_dtype", "torch_dtype", "host", "differentiable", "quiet",
           "using"]


@contextlib.contextmanager
def using(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` while a model runs: the model's Python-float
    constants (``dist.Normal(0.0, 1.0)``) then meet ``theta`` and the data in one dtype."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Pyro's and torch's argument validation off: the checks turn values into Python booleans,
    which ``torch.func`` transforms cannot do (the data are validated before a run)."""
    with pyro.validation_enabled(False):
        yield


# Pyro's handler stack and torch's default dtype are global, and XLA may run two callbacks of a
# round at once on its threads: one torch evaluation at a time
_LOCK = threading.Lock()

# torch-side subclasses of the core's NamedTuples (the port's Gaussians), converted to the core's
CORE_TYPES: dict[type, type] = {}


def _convert(tree: Any, leaf: Callable) -> Any:
    if isinstance(tree, (torch.Tensor, jax.Array, np.ndarray)):
        return leaf(tree)
    if isinstance(tree, tuple):
        parts = [_convert(x, leaf) for x in tree]
        if hasattr(tree, "_fields"):
            return CORE_TYPES.get(type(tree), type(tree))(*parts)
        return tuple(parts)
    if isinstance(tree, list):
        return [_convert(x, leaf) for x in tree]
    if isinstance(tree, dict):
        return {k: _convert(v, leaf) for k, v in tree.items()}
    return tree


def to_jax(tree: Any) -> Any:
    """``tree`` (tuples, NamedTuples, lists, dicts) with its torch tensors as JAX arrays (same
    dtype; other leaves as they are)."""
    def leaf(x):
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            jax_dtype(x.dtype)  # refused without JAX's 64-bit mode, naming it: never downcast
        return jnp.asarray(x.detach().cpu().numpy()) if isinstance(x, torch.Tensor) else x

    return _convert(tree, leaf)


def to_torch(tree: Any) -> Any:
    """``tree`` with its JAX and NumPy arrays as torch tensors (same dtype)."""
    return _convert(tree, lambda x: x if isinstance(x, torch.Tensor)
                    else torch.as_tensor(np.array(x)))


def jax_dtype(dtype: torch.dtype) -> Any:
    """The JAX dtype of a torch floating dtype; float64 needs JAX's 64-bit mode."""
    if dtype == torch.float64 and not jax.config.read("jax_enable_x64"):
        raise TypeError("the guide computes in torch.float64, which the core (JAX) runs only "
                        "with 64-bit floats enabled: call numpyro.enable_x64() (or "
                        "jax.config.update('jax_enable_x64', True)) first, or give the guide "
                        "dtype=torch.float32")
    return jnp.dtype(str(dtype).removeprefix("torch."))


def torch_dtype(dtype: Any) -> torch.dtype:
    return getattr(torch, np.dtype(dtype).name)


def _mapped(fn: Callable, levels: int) -> Callable:
    """``fn`` mapped over ``levels`` leading axes of its (flat, tensor) arguments; an argument
    of size 1 on an axis is broadcast along it (what ``vmap_method="expand_dims"`` gives for the
    arguments a ``jax.vmap`` level does not batch)."""
    if levels == 0:
        return fn
    inner = _mapped(fn, levels - 1)

    def call(*args):
        size = max(a.shape[0] for a in args)
        dims = tuple(0 if a.shape[0] == size else None for a in args)
        args = tuple(a if d == 0 else a[0] for a, d in zip(args, dims, strict=True))
        return torch.func.vmap(inner, dims, randomness="same")(*args)

    return call


def host(fn: Callable, out: Any, *args: Any) -> Any:
    """``fn(*tensors)`` on torch, called from JAX: ``args`` (a pytree of arrays) reach ``fn``
    flattened, as tensors; ``out`` is the pytree of ``jax.ShapeDtypeStruct`` it returns (None:
    found by calling ``fn`` once on zeros of the arguments' shapes). Any ``jax.vmap`` around the
    call becomes a ``torch.func.vmap`` around ``fn`` (Pyro's validation off, torch's default
    dtype the first floating one among the arguments)."""
    flat, _ = jax.tree_util.tree_flatten(args)
    ranks = [jnp.ndim(a) for a in flat]
    floats = [a.dtype for a in flat if jnp.issubdtype(a.dtype, jnp.floating)]
    dtype = torch_dtype(floats[0]) if floats else torch.get_default_dtype()
    if out is None:
        with quiet(), using(dtype):
            dry = fn(*(torch.zeros(a.shape, dtype=torch_dtype(a.dtype)) for a in flat))
        out = jax.tree_util.tree_map(lambda t: jax.ShapeDtypeStruct(
            tuple(t.shape), jnp.dtype(str(t.dtype).removeprefix("torch."))), dry,
            is_leaf=lambda x: isinstance(x, torch.Tensor))

    def callback(*arrays):
        levels = np.ndim(arrays[0]) - ranks[0]
        tensors = [torch.as_tensor(np.array(a)) for a in arrays]
        with _LOCK, quiet(), using(dtype):
            result = _mapped(fn, levels)(*tensors)
        return jax.tree_util.tree_map(lambda t, o: t.detach().numpy().astype(o.dtype),
                                      _convert(result, lambda t: t), out)

    return jax.pure_callback(callback, out, *flat, vmap_method="expand_dims")


def differentiable(fn: Callable) -> Callable:
    """A scalar torch function ``fn(x, *rest)`` as a JAX function of the same arguments whose
    derivatives in ``x`` (``jax.grad``, ``jax.hessian``, ``jax.jvp``) are torch's; ``rest`` are
    held fixed (their tangents are ignored)."""
    grad = torch.func.grad(fn)
    hess = torch.func.jacrev(grad)

    def call(torch_fn, shape):
        return lambda x, *rest: host(torch_fn, jax.ShapeDtypeStruct(shape(x), x.dtype), x, *rest)

    value_fn = call(fn, lambda x: ())
    grad_fn = jax.custom_jvp(call(grad, lambda x: x.shape))
    hess_fn = call(hess, lambda x: x.shape * 2)
    value = jax.custom_jvp(value_fn)

    @value.defjvp
    def _value_jvp(primals, tangents):
        x, *rest = primals
        return value(x, *rest), jnp.sum(grad_fn(x, *rest) * tangents[0])

    @grad_fn.defjvp
    def _grad_jvp(primals, tangents):
        x, *rest = primals
        return grad_fn(x, *rest), hess_fn(x, *rest) @ tangents[0]

    return value
