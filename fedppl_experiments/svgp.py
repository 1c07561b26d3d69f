"""Structured variational GPs on a UCI folder: the thesis's protocol (Chs. 2-3).

One standard split of the folder (90 % train, 10 % test, the thesis's proportions) is
standardised with the training statistics (inputs and target), one method is fitted with
numpyro's ``SVI`` and an optax optimiser on minibatches, and scored on the test set:
standardised RMSE (the thesis's measure), the average test log-likelihood (standardised units)
and the RMSE in original units.

Methods (:data:`METHODS`), with the thesis's settings as defaults (:class:`Settings`):

* ``svigp``: Hensman's full-``S`` guide, ``M`` inducing inputs started at random training inputs
  and learned, every hyperparameter learned (GPy's SVIGP, the thesis's baseline);
* ``diag``: the (alpha, Sigma) family of Eq. 2.8 (exact ``O(M^3)`` bound, Eq. 2.12);
* ``rnvgp``: the same family with RNVGP's randomised ``O(d T M^2)`` gradients (Ch. 3);
* ``kron``, ``tvgp``, ``sumkron``: grid guides (``m0`` points per dimension over the training
  range), TVGP with rank ``q0``, ``terms`` Kronecker terms; kernel variance 1 and noise variance
  0.1 fixed, lengthscales learned (as in the thesis, Sec. 2.5.1).

Example (with the UCI folders of ``../shared/data/uci``)::

    row = run("../shared/data/uci/power-plant", split=0, method="tvgp",
              settings=Settings(m0=5, q0=3, batch_size=10, steps=50_000))
    row["rmse"], row["seconds"]
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedppl.datasets import Standardiser, load_uci

__all__ = ["METHODS", "GRID_METHODS", "Settings", "Prepared", "prepare", "build", "fit",
           "score", "run"]

METHODS = ("svigp", "diag", "rnvgp", "kron", "tvgp", "sumkron")
GRID_METHODS = ("kron", "tvgp", "sumkron")
OPTIMISERS = {"adam": optax.adam, "adagrad": optax.adagrad, "sgd": optax.sgd}


class Settings(NamedTuple):
    """Sizes, optimisation and estimator settings (defaults: the thesis's best CCPP TVGP and
    Boston RNVGP/SVIGP conditions where they apply)."""

    num_inducing: int = 200       # M for svigp, diag, rnvgp
    m0: int = 5                   # grid points per dimension (kron, tvgp, sumkron)
    q0: int = 3                   # Tucker rank (tvgp)
    terms: int = 1                # Kronecker terms (sumkron)
    batch_size: int | None = 100  # b (None: every training point)
    steps: int = 5000
    optimizer: str = "adam"
    learning_rate: float = 0.01
    learn_inducing: bool | None = None   # None: learned for svigp only
    sigma: float = 1.0            # initial diagonal of Sigma (diag, rnvgp and the grid guides)
    probes: int = 5               # RNVGP: d
    tol_first: float = 1e-3       # RNVGP: epsilon_L
    tol: float = 1e-6             # RNVGP: epsilon
    roulette: float = 0.1         # RNVGP: beta
    seed: int = 0


class Prepared(NamedTuple):
    X: np.ndarray        # standardised training inputs
    y: np.ndarray        # standardised training targets
    X_test: np.ndarray   # standardised test inputs
    y_test: np.ndarray   # test targets, original units
    scaler: Standardiser


def prepare(path: str, split: int = 0, max_train: int | None = None, seed: int = 0) -> Prepared:
    """Load split ``split`` and standardise inputs and target on its training part
    (``max_train`` keeps a random subset of training rows, for quick runs)."""
    data = load_uci(path, split)
    train = data.train
    if max_train is not None and len(train) > max_train:
        train = np.sort(np.random.default_rng(seed).choice(train, max_train, replace=False))
    sc = Standardiser.fit(data.X[train], data.y[train])
    return Prepared(sc.transform_X(data.X[train]), sc.transform_y(data.y[train]),
                    sc.transform_X(data.X[data.test]), data.y[data.test], sc)


def build(method: str, X: np.ndarray, s: Settings) -> tuple[Any, Any]:
    """The NumPyro model and guide of ``method`` for training inputs ``X``."""
    from fedppl.guides import kronecker, rnvgp
    from fedppl.guides import svgp as dense
    from fedppl.models import svgp

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if method in GRID_METHODS:
        model = svgp.SparseGPRegression(svgp.Grid.over(X, s.m0), batch_size=s.batch_size,
                                        variance=1.0, noise=0.1**0.5, learn=("lengthscale",))
        guide = {"kron": lambda: kronecker.KroneckerGuide(model, sigma=s.sigma),
                 "tvgp": lambda: kronecker.TuckerGuide(model, rank=s.q0, sigma=s.sigma),
                 "sumkron": lambda: kronecker.SumKroneckerGuide(model, terms=s.terms,
                                                                sigma=s.sigma)}[method]()
        return model, guide
    M = min(int(s.num_inducing), X.shape[0])
    Z = X[np.random.default_rng(s.seed).choice(X.shape[0], M, replace=False)]
    learn_z = method == "svigp" if s.learn_inducing is None else s.learn_inducing
    model = svgp.SparseGPRegression(svgp.Points(Z, learn=learn_z), batch_size=s.batch_size,
                                    noise=0.1**0.5)
    if method == "svigp":
        return model, dense.SVIGPGuide(model)
    if method == "diag":
        return model, dense.DiagGuide(model, sigma=s.sigma)
    cfg = rnvgp.RandomisedConfig(probes=s.probes, tol_first=s.tol_first, tol=s.tol,
                                 roulette=s.roulette)
    return model, rnvgp.RNVGPGuide(model, cfg, sigma=s.sigma)


def fit(method: str, X: np.ndarray, y: np.ndarray, s: Settings, progress_bar: bool = False
        ) -> tuple[Any, Any, Any, float]:
    """``(model, guide, SVIRunResult, seconds)`` after ``s.steps`` steps of numpyro's SVI."""
    from numpyro.infer import SVI

    from fedppl.models.svgp import InducingELBO

    if s.optimizer not in OPTIMISERS:
        raise ValueError(f"unknown optimizer {s.optimizer!r}; choose from {tuple(OPTIMISERS)}")
    model, guide = build(method, X, s)
    svi = SVI(model, guide, OPTIMISERS[s.optimizer](s.learning_rate), InducingELBO())
    start = time.perf_counter()
    result = svi.run(jax.random.key(s.seed), s.steps, jnp.asarray(X), jnp.asarray(y),
                     progress_bar=progress_bar)
    jax.block_until_ready(result.params)
    return model, guide, result, time.perf_counter() - start


def score(model: Any, guide: Any, params: dict, prep: Prepared) -> dict[str, float]:
    """Test RMSE (standardised and original units), average test log-likelihood (standardised
    units) of the predictive ``N(mean, var + s2)``, and the training RMSE (standardised)."""
    from fedppl.models.svgp import predict

    predictive = jax.jit(lambda p, X: predict(model, guide, p, X, noise=True))
    mean, var = (np.asarray(a) for a in predictive(params, jnp.asarray(prep.X_test)))
    y = prep.scaler.transform_y(prep.y_test)
    ll = -0.5 * np.log(2 * np.pi * var) - 0.5 * (y - mean) ** 2 / var
    orig = prep.scaler.inverse_transform_y(mean)
    fitted = np.asarray(predictive(params, jnp.asarray(prep.X))[0])
    return {"rmse": float(np.sqrt(np.mean((y - mean) ** 2))),
            "log_lik": float(np.mean(ll)),
            "rmse_original": float(np.sqrt(np.mean((prep.y_test - orig) ** 2))),
            "train_rmse": float(np.sqrt(np.mean((prep.y - fitted) ** 2)))}


def run(path: str, split: int = 0, method: str = "tvgp", settings: Settings | None = None,
        max_train: int | None = None, progress_bar: bool = False) -> dict[str, Any]:
    """Fit and score one method on one split; a flat dict of metrics, settings and the loss
    curve (every ``steps // 100``-th value)."""
    s = settings or Settings()
    prep = prepare(path, split, max_train, seed=s.seed)
    model, guide, result, seconds = fit(method, prep.X, prep.y, s, progress_bar)
    losses = np.asarray(result.losses)
    every = max(1, len(losses) // 100)
    return {"method": method, "split": split, **score(model, guide, result.params, prep),
            "seconds": seconds, "seconds_per_step": seconds / max(s.steps, 1),
            "num_inducing": model.num_inducing, "num_train": len(prep.y),
            "final_loss": float(np.mean(losses[-every:])), "settings": s._asdict(),
            "loss_curve": losses[::every].tolist()}
