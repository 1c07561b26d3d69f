"""Export a fedppl result to ArviZ 1.x, with a ``client`` dimension for the client factors.

Every result's ``to_arviz()`` returns an ``xarray.DataTree`` built by ``arviz_base.from_dict``:
what ``arviz_stats`` (``summary``, ``ess``, ``rhat``, ``loo``) and ``arviz_plots`` (``plot_dist``,
``plot_forest``...) take. Posterior draws are independent draws of the approximate posterior,
arranged as :data:`NUM_CHAINS` chains of ``num_samples / NUM_CHAINS`` draws, so r-hat is defined
(and near 1: the chains are independent draws of one distribution).

Example::

    >>> import jax, numpy as np, fedppl
    >>> from arviz_stats import summary
    >>> from fedppl.models import linear_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> result = fedppl.PVI(model, fedppl.PVIGuide(model)).run(
    ...     jax.random.key(0), clients, num_rounds=1, progress_bar=False)
    >>> dt = result.to_arviz(jax.random.key(0), num_samples=400)
    >>> dt.posterior["w"].shape                      # (chain, draw, w_dim_0)
    (4, 100, 2)
    >>> dt.constant_data["factor_nat1"].dims         # each t_k in natural parameters, per client
    ('client', 'theta')
    >>> table = summary(dt, var_names=["w"])     # mean, sd, interval, ess, r_hat, mcse
    >>> bool(table["r_hat"].max() < 1.05), list(table.index)
    (True, ['w[0]', 'w[1]'])
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any

import numpy as np

from fedppl import validation

__all__ = ["NUM_CHAINS", "from_dict", "as_chains", "check_num_samples",
           "history_attrs", "arviz_base", "arviz_stats", "arviz_plots"]

#: Chains the posterior draws of every ``to_arviz()`` are split into.
NUM_CHAINS = 4
EXTRA = "ArviZ export needs the arviz extra: pip install 'fedppl[arviz]'"


def _missing(e: ImportError) -> ImportError:  # pragma: no cover - depends on the environment
    return ImportError(f"{EXTRA} (could not import {e.name})")


def arviz_base() -> ModuleType:
    """The ``arviz_base`` module (data: ``from_dict``, ``extract``...)."""
    try:
        import arviz_base
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise _missing(e) from e
    return arviz_base


def arviz_stats() -> ModuleType:
    """The ``arviz_stats`` module (``summary``, ``ess``, ``rhat``, ``loo``, PSIS)."""
    try:
        import arviz_stats
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise _missing(e) from e
    return arviz_stats


def _load_matplotlib_style_core() -> None:
    """Import ``matplotlib.style.core`` (deprecated in Matplotlib 3.11, silently here) so that
    ``matplotlib.style.core``, which arviz-plots 0.8 reads at import, exists."""
    import matplotlib.style

    if not hasattr(matplotlib.style, "core"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("matplotlib.style.core")


def arviz_plots() -> ModuleType:
    """The ``arviz_plots`` module, importable beside Matplotlib 3.11.

    arviz-plots 0.8 registers its styles through ``matplotlib.style.core``, a submodule that
    Matplotlib 3.11 deprecated and no longer imports itself (arviz-plots issue #500), so a bare
    ``import arviz_plots`` fails there with ``AttributeError``. This loads the submodule first
    (silencing its deprecation warning), and arviz-plots' Matplotlib backend (silencing
    Matplotlib 3.11's pending deprecation of how it registers a scale). After one call, or
    after any ``to_arviz()``, a plain ``import arviz_plots`` works too."""
    _load_matplotlib_style_core()
    try:
        import arviz_plots
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise _missing(e) from e
    with warnings.catch_warnings():  # its Matplotlib backend registers a scale the old way
        warnings.filterwarnings("ignore", "The scale 'SquareRootScale' uses an 'axis'",
                                PendingDeprecationWarning)
        importlib.import_module("arviz_plots.backend.matplotlib")
    return arviz_plots


def check_num_samples(num_samples: Any) -> int:
    """A positive multiple of :data:`NUM_CHAINS`, at least that many draws per chain."""
    n = validation.positive_int(num_samples, "num_samples")
    if n % NUM_CHAINS or n < NUM_CHAINS**2:
        raise ValueError(f"num_samples must be a multiple of {NUM_CHAINS} and at least "
                         f"{NUM_CHAINS**2} (the draws are exported as {NUM_CHAINS} chains of "
                         f"num_samples / {NUM_CHAINS}), got {n}")
    return n


def as_chains(draws: Any) -> np.ndarray:
    """``(S, ...)`` independent draws as ``(NUM_CHAINS, S / NUM_CHAINS, ...)``."""
    arr = np.asarray(draws)
    n = check_num_samples(arr.shape[0])
    return arr.reshape(NUM_CHAINS, n // NUM_CHAINS, *arr.shape[1:])


def _attr(value: Any) -> Any:
    """An attribute value netCDF can store (None as the string ``"None"``, arrays as lists)."""
    if value is None:
        return "None"
    if hasattr(value, "__array__"):  # NumPy, JAX or torch arrays and scalars
        return np.asarray(value).tolist()
    return value


def from_dict(groups: dict[str, dict[str, Any] | None], *, dims: dict[str, list] | None = None,
              coords: dict[str, Any] | None = None,
              attrs: dict[str, dict[str, Any]] | None = None, **kwargs: Any):
    """``arviz_base.from_dict`` of the non-empty groups (arrays converted to NumPy; groups whose
    name holds ``data`` have no sample dimensions), with ``attrs`` per group."""
    ab = arviz_base()
    arviz_stats()  # summaries need it: fail at export, not at the first summary
    _load_matplotlib_style_core()  # then a plain ``import arviz_plots`` works too
    data = {name: {k: np.asarray(v) for k, v in group.items()}
            for name, group in groups.items() if group}
    attrs = {name: {k: _attr(v) for k, v in a.items()}
             for name, a in (attrs or {}).items() if name in data or name == "/"}
    return ab.from_dict(data, dims=dims, coords=coords, attrs=attrs, **kwargs)


def history_attrs(history: dict[str, Any]) -> dict[str, Any]:
    """The run's final local free energy, number of rounds, ``converged`` and ``kl_change``."""
    out: dict[str, Any] = {}
    fe = history.get("free_energy")
    if fe is not None and len(fe):
        out["final_local_free_energy"] = np.asarray(fe[-1]).tolist()
        out["num_rounds"] = len(fe)
    for key in ("converged", "kl_change"):
        values = history.get(key)
        if values is not None and len(values):
            out[f"final_{key}"] = np.asarray(values[-1]).tolist()
    return out
