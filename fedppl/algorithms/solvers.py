"""Which local step PVI's clients take: a pure function of the settings, the guide and the
clients (:func:`choose_solver`), and the hashable pieces a solver is built from.

:class:`fedppl.PVI` (and ``GlobalVI``) call :func:`choose_solver` once per run, after the guide
is set up on the clients' data and the clients are checked against the model. It returns the
clients' :class:`~fedppl.algorithms.pvi.LocalSolver`, the server's
:class:`~fedppl.algorithms.natural_gradient.PriorSolver` for a prior that is not Gaussian in
the unconstrained space (None otherwise), and a private run's noise calibration; each setting
that cannot apply raises a ``ValueError`` that says why. Every solver it returns is a hashable
value (NamedTuples of settings, the model and the guide, which compare by structure), so that
two methods with the same settings get equal solvers, and so share their compiled rounds.

Example (a conjugate model gets the closed-form step; logistic regression the natural-gradient
one)::

    >>> import numpy as np, fedppl
    >>> from fedppl.models import linear_regression, logistic_regression
    >>> X = np.random.default_rng(0).normal(size=(40, 2))
    >>> clients = fedppl.partition.homogeneous(X, (X[:, 0] > 0) * 1.0, num_clients=2, seed=0)
    >>> guide = fedppl.PVIGuide(linear_regression).setup(*clients.client(0))
    >>> type(choose_solver(Settings(), linear_regression, guide, clients).local).__name__
    'ConjugateSolver'
    >>> guide = fedppl.PVIGuide(logistic_regression).setup(*clients.client(0))
    >>> type(choose_solver(Settings(), logistic_regression, guide, clients).local).__name__
    'NaturalGradientSolver'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import optax
from jax import Array

from fedppl.algorithms import conjugate, polya_gamma, pvi
from fedppl.algorithms.natural_gradient import PriorSolver
from fedppl.clients import Clients
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.handlers.client import client
from fedppl.sites import curvature

__all__ = ["Settings", "Choice", "Calibration", "PriorCorrection", "BoundModel", "bind",
           "choose_solver", "DEFAULT_OPTIMIZER"]

# optax.adam(1e-2), made once: a new one per method would make every solver that holds it new
DEFAULT_OPTIMIZER = optax.adam(1e-2)


class Settings(NamedTuple):
    """The local step's settings, as :class:`fedppl.PVI` takes them (``pooled``: GlobalVI, one
    client whose likelihood includes the prior's correction)."""

    conjugate: bool | str = "auto"
    solver: str = "natural-gradient"
    optimizer: optax.GradientTransformation = DEFAULT_OPTIMIZER
    local_steps: int | None = None
    num_particles: int | None = None
    local_tol: float | None = None
    privacy: Any = None
    pooled: bool = False


class Calibration(NamedTuple):
    """A private run's noise multiplier and the local steps it was calibrated for."""

    sigma: float
    steps: int


class Choice(NamedTuple):
    """The clients' local solver, the server's prior solver (None: the prior is Gaussian in the
    unconstrained space, or GlobalVI folds it into the likelihood) and a private run's
    calibration (None: not private)."""

    local: pvi.LocalSolver
    prior: PriorSolver | None
    calibration: Calibration | None


@dataclass(frozen=True)
class PriorCorrection:
    """``guide.prior_correction`` as a value: equal to another's when their guides are equal
    (the correction itself is a new function at every set-up of a guide)."""

    guide: PVIGuide

    def __call__(self, theta: Array) -> Array:
        correction = self.guide.prior_correction
        assert correction is not None  # made only for a guide that has one
        return correction(theta)


class BoundModel:
    """``model`` with static keyword arguments bound (``functools.partial``'s call), equal to
    another with an equal model and equal arguments (arrays compare by value)."""

    def __init__(self, func: Callable, keywords: Mapping[str, Any]):
        self.func, self.keywords = func, dict(keywords)
        self.__name__ = getattr(func, "__name__", type(func).__name__)
        self._key = (func, tuple(sorted((k, _frozen(v)) for k, v in self.keywords.items())))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **{**self.keywords, **kwargs})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BoundModel) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"BoundModel({self.__name__}, {self.keywords!r})"


def bind(model: Callable, model_kwargs: Mapping[str, Any]) -> Callable:
    """``model`` with ``model_kwargs`` bound (a :class:`BoundModel`), or ``model`` itself when
    there are none."""
    return BoundModel(model, model_kwargs) if model_kwargs else model


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a keyword argument's value: itself, an array's bytes, or (for
    anything else unhashable) its identity, which equals no other value."""
    try:
        hash(value)
        return value
    except TypeError:
        pass
    if hasattr(value, "__array__"):
        arr = np.asarray(value)
        return ("array", arr.shape, str(arr.dtype), arr.tobytes())
    return ("object", id(value))


def choose_solver(settings: Settings, model: Callable, guide: PVIGuide, clients: Clients
                  ) -> Choice:
    """The local solver for ``settings`` on ``model`` (static keyword arguments bound) with
    ``guide`` set up on the clients' data (see the module doc): the closed form where the
    likelihood is Gaussian and affine in the global sites (``conjugate="auto"``), Polya-Gamma
    CAVI, DP optimisation (``privacy``), optax, or the natural-gradient step."""
    has_local = guide.local_layout is not None
    correction = None if guide.prior_correction is None else PriorCorrection(guide)
    fold_prior = settings.pooled and correction is not None

    def opt(value, default):
        return default if value is None else value

    S, iters = opt(settings.num_particles, 128), opt(settings.local_steps, 100)
    tol = opt(settings.local_tol, 1e-10)
    layout = guide.layout
    assert layout is not None, "set the guide up (guide.setup) before choosing its solver"
    prior_solver = None
    if correction is not None and not fold_prior:
        prior_solver = PriorSolver(correction, S, iters, tol, hessian=curvature(layout))
    reason = None
    if has_local:
        reason = "the model has local latent sites"
    elif fold_prior:
        reason = "the prior is not Gaussian (GlobalVI folds it into the likelihood)"
    privacy, conj = settings.privacy, settings.conjugate
    if privacy is not None and conj in (True, "polya-gamma"):
        raise ValueError(f"conjugate={conj!r} is not available with privacy=: a "
                         "private run's local step is DP optimisation")
    if conj == "polya-gamma":
        if reason:
            raise ValueError(f"conjugate='polya-gamma' is not available: {reason}")
        polya_gamma.validate(model, guide, clients)
        return Choice(polya_gamma.PolyaGammaSolver(model, guide, opt(settings.local_steps, 200),
                                                   opt(settings.local_tol, 1e-10)),
                      prior_solver, None)
    if conj is not False and reason is None and privacy is None:
        data, mask = clients.padded(0)
        why = conjugate.check(client(model, mask=mask), layout, *data)
        if why is None:
            return Choice(pvi.ConjugateSolver(model, guide), prior_solver, None)
        if conj is True:
            raise ValueError(f"conjugate=True but the model is not conjugate: {why}")
    elif conj is True:
        raise ValueError(f"conjugate=True is not available: {reason}")
    if privacy is not None:
        if reason:
            raise ValueError(f"privacy= is not available: {reason}")
        steps, particles = opt(settings.local_steps, 200), opt(settings.num_particles, 8)
        sigma = privacy.calibrated(np.asarray(clients.sizes), steps)
        return Choice(privacy.solver(model, guide, settings.optimizer, steps, particles, sigma),
                      prior_solver, Calibration(sigma, steps))
    if settings.solver == "optax":
        if reason:
            raise ValueError(f"solver='optax' is not available: {reason}; use the default "
                             "natural-gradient solver")
        return Choice(pvi.VariationalSolver(model, guide, settings.optimizer,
                                            opt(settings.local_steps, 200),
                                            opt(settings.num_particles, 8),
                                            opt(settings.local_tol, 1e-4)), prior_solver, None)
    return Choice(pvi.NaturalGradientSolver(model, guide, S, iters, tol,
                                            extra=correction if fold_prior else None,
                                            hessian=curvature(layout)
                                            if fold_prior else "pointwise"),
                  prior_solver, None)
