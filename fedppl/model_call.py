"""How fedppl calls a user's model with a client's arrays: ``model(*arrays, **model_kwargs)``.

:func:`positional` lets a model whose data arguments are keyword-only (``def model(*, X,
y=None)``) take them positionally; :func:`model_error` re-raises a model's failure on a
client's data with the model's argument names and the arrays' shapes. fedppl traces a model
(compiles it, or finds its shapes) rather than running it op by op, where each new data shape
compiles each operation again; :data:`READS_VALUES` are the errors of a model that reads its
data's values while tracing (``int(g.max()) + 1`` groups), which then runs op by op.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["KeywordData", "positional", "model_name", "arg_names", "model_error", "READS_VALUES"]

#: what tracing a model that reads its data's values raises (run it op by op instead): JAX's
#: concretization and tracer-conversion errors are ``TypeError``s, as is a data argument that
#: is not an array
READS_VALUES = (TypeError,)


class KeywordData:
    """A model whose data arguments are keyword-only (``def model(*, X, y=None)``), callable
    with its data positionally, as fedppl calls every model (``model(*client_arrays,
    **model_kwargs)``): the arrays beyond the model's positional parameters go, in order, to its
    keyword-only parameters in the order they are declared. Build with :func:`positional`.

    Example::

        >>> def kw_model(*, X, y=None):
        ...     return X.shape, y
        >>> positional(kw_model)(np.zeros((3, 2)), None)
        ((3, 2), None)
    """

    def __init__(self, model: Callable, num_positional: int, keywords: tuple[str, ...]):
        self.model = model
        self.num_positional = num_positional
        self.keywords = keywords
        functools.update_wrapper(self, model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        extra = args[self.num_positional:]
        if not extra:
            return self.model(*args, **kwargs)
        if len(extra) > len(self.keywords):
            raise TypeError(
                f"{model_name(self.model)} takes {self.num_positional} positional and "
                f"{len(self.keywords)} keyword-only arguments {list(self.keywords)}, but was "
                f"given {len(args)} data arrays"
            )
        named = dict(zip(self.keywords, extra, strict=False))
        clash = sorted(set(named) & set(kwargs))
        if clash:
            raise TypeError(f"{model_name(self.model)}: {clash} given both as the clients' data "
                            "arrays and as keyword arguments")
        return self.model(*args[:self.num_positional], **named, **kwargs)


def positional(model: Callable) -> Callable:
    """``model``, or for a model with keyword-only parameters (``def model(*, X, y=None)``) a
    :class:`KeywordData` that also takes the data positionally. A model with ``*args``, or one
    whose signature cannot be read, is returned as it is."""
    if isinstance(model, KeywordData):
        return model
    try:
        params = list(inspect.signature(model).parameters.values())
    except (TypeError, ValueError):
        return model
    kinds = [p.kind for p in params]
    keywords = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)
    if not keywords or inspect.Parameter.VAR_POSITIONAL in kinds:
        return model
    num_positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY,
                               inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    return KeywordData(model, num_positional, keywords)


def model_name(model: Callable) -> str:
    return f"{getattr(model, '__name__', type(model).__name__)}()"


def arg_names(model: Callable, count: int) -> list[str]:
    """The names the model gives its first ``count`` positional data arguments (``argument i``
    where the signature does not say)."""
    names: list[str] = []
    try:
        params = inspect.signature(model).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if isinstance(model, KeywordData):
            names = names[:model.num_positional] + list(model.keywords)
    except (TypeError, ValueError):
        pass
    return (names + [f"argument {i}" for i in range(len(names), count)])[:count]


def model_error(err: Exception, model: Callable, args: tuple, kwargs: dict) -> Exception:
    """``err`` (a model failing on its data) with the model's arguments and their shapes, and a
    hint where one argument is 1-D; the same exception type where that is a plain built-in."""
    names = arg_names(model, len(args))
    shapes = ", ".join(f"{n} {tuple(np.shape(a))}" for n, a in zip(names, args, strict=True))
    msg = (f"the model {model_name(model)} fails on the clients' data ({shapes}"
           f"{', keyword arguments ' + str(sorted(kwargs)) if kwargs else ''}): "
           f"{type(err).__name__}: {err}")
    flat = [n for n, a in zip(names, args, strict=True) if np.ndim(a) == 1]
    if isinstance(err, IndexError) and flat and np.ndim(args[0]) == 1:
        msg += (f". {names[0]} is 1-D: inputs are (N, D) arrays of N rows and D features; "
                f"use {names[0]}[:, None] for one feature")
    if type(err) in (IndexError, TypeError, ValueError, AttributeError, KeyError):
        return type(err)(msg)
    err.add_note(msg)
    return err
