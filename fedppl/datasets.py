"""Load regression benchmarks, standardise them and split them into train/test/validation.

:func:`load_uci` reads one folder of the UCI regression benchmarks in the layout of
Hernandez-Lobato & Adams (2015) / Gal & Ghahramani (2016): ``data.txt`` (whitespace-separated),
``index_features.txt``, ``index_target.txt``, ``n_splits.txt`` and ``index_{train,test}_{i}.txt``.
The loader takes a path and assumes nothing about where the data live.

Example::

    >>> from fedppl import datasets, partition
    >>> data = datasets.load_uci("path/to/uci/concrete", split=0)
    >>> scaler = datasets.Standardiser.fit(data.X[data.train], data.y[data.train])
    >>> X_tr, y_tr = scaler.transform_X(data.X[data.train]), scaler.transform_y(data.y[data.train])
    >>> clients = partition.paired_chunks(X_tr, y_tr, num_clients=10, seed=0)
    >>> # back to original units: mean * y_std + y_mean; log-lik: subtract log(y_std)
    >>> split = datasets.train_test_val_split(data.X, data.y, (0.8, 0.1, 0.1), seed=0)
    >>> split.train, split.test, split.val            # disjoint index arrays
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["UCIData", "load_uci", "Standardiser", "Split", "train_test_val_split"]


class UCIData(NamedTuple):
    """One UCI dataset: inputs ``X`` (N, D), target ``y`` (N,), both float64.

    ``train``/``test`` are the row indices of the requested split (``None`` without a split);
    ``n_splits`` is the number of standard splits (``None`` if ``n_splits.txt`` is absent).
    """

    X: np.ndarray
    y: np.ndarray
    train: np.ndarray | None = None
    test: np.ndarray | None = None
    n_splits: int | None = None


def _file(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"UCI dataset file not found: {path}")
    return path


def _indices(folder: Path, name: str) -> np.ndarray:
    return np.loadtxt(_file(folder, name), dtype=np.int64, ndmin=1)


def load_uci(path: str | Path, split: int | None = None) -> UCIData:
    """Read the dataset folder ``path``, with the train/test indices of ``split`` if given.

    Raises ``FileNotFoundError`` (naming the path) for a missing folder or file, and
    ``ValueError`` for a split out of range or indices that do not fit the data.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"UCI dataset folder not found: {folder}")
    data = np.loadtxt(_file(folder, "data.txt"), dtype=np.float64, ndmin=2)
    features = _indices(folder, "index_features.txt")
    target = _indices(folder, "index_target.txt")
    if target.size != 1:
        raise ValueError(f"{folder / 'index_target.txt'} should hold one column index, "
                         f"got {target.tolist()}")
    cols = np.append(features, target)
    if cols.min() < 0 or cols.max() >= data.shape[1]:
        raise ValueError(f"column indices {cols.tolist()} out of range for {data.shape[1]} columns "
                         f"in {folder / 'data.txt'}")
    X, y = data[:, features], data[:, int(target[0])]

    n_path = folder / "n_splits.txt"
    n_splits = int(np.loadtxt(n_path, dtype=np.int64)) if n_path.is_file() else None
    if split is None:
        return UCIData(X, y, n_splits=n_splits)
    if n_splits is None:
        _file(folder, "n_splits.txt")  # raises, naming the path
    if not 0 <= split < n_splits:
        raise ValueError(f"split {split} out of range: {folder} has {n_splits} splits "
                         f"(0 to {n_splits - 1})")
    train = _indices(folder, f"index_train_{split}.txt")
    test = _indices(folder, f"index_test_{split}.txt")
    for name, idx in (("train", train), ("test", test)):
        if idx.size and (idx.min() < 0 or idx.max() >= X.shape[0]):
            raise ValueError(f"{name} indices of split {split} out of range for {X.shape[0]} rows")
    return UCIData(X, y, train, test, n_splits)


@dataclass(frozen=True)
class Standardiser:
    """Per-column mean and standard deviation of training ``X`` and ``y`` (std 0 becomes 1).

    A constant column (max == min) maps to exactly 0. Build with :meth:`fit`. Predictions go
    back to original units with :meth:`inverse_transform_y`; a log density of standardised ``y``
    becomes one of original ``y`` by subtracting ``log(y_std)`` (the log-Jacobian of the scaling).
    """

    x_mean: np.ndarray
    x_std: np.ndarray
    y_mean: np.ndarray | float
    y_std: np.ndarray | float

    @staticmethod
    def _moments(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Constant columns are found exactly (max == min): their float std can be ~1e-16
        # rather than 0 (naval-propulsion-plant), which would blow rounding noise up.
        const = np.ptp(a, axis=0) == 0
        mean = np.where(const, a[0], a.mean(axis=0))
        return mean, np.where(const, 1.0, a.std(axis=0))

    @classmethod
    def fit(cls, X: np.ndarray, y: np.ndarray) -> Standardiser:
        """Moments of the training arrays ``X`` (N, D) and ``y`` (N,) or (N, K)."""
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if X.ndim != 2 or y.ndim not in (1, 2) or X.shape[0] != y.shape[0] or X.shape[0] == 0:
            raise ValueError(f"need X of shape (N, D) and y of shape (N,) with N > 0, "
                             f"got {X.shape} and {y.shape}")
        x_mean, x_std = cls._moments(X)
        y_mean, y_std = cls._moments(y)
        if y.ndim == 1:
            y_mean, y_std = float(y_mean), float(y_std)
        return cls(x_mean, x_std, y_mean, y_std)

    def transform_X(self, X: np.ndarray) -> np.ndarray:
        return (np.asarray(X, dtype=np.float64) - self.x_mean) / self.x_std

    def transform_y(self, y: np.ndarray) -> np.ndarray:
        return (np.asarray(y, dtype=np.float64) - self.y_mean) / self.y_std

    def inverse_transform_y(self, y: np.ndarray) -> np.ndarray:
        """Standardised ``y`` (or a predictive mean) back in original units."""
        return np.asarray(y, dtype=np.float64) * self.y_std + self.y_mean


class Split(NamedTuple):
    """Disjoint, sorted row indices of a train/test/validation split."""

    train: np.ndarray
    test: np.ndarray
    val: np.ndarray


def train_test_val_split(X: np.ndarray, y: np.ndarray,
                         fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0) -> Split:
    """Uniformly random split of the rows into ``fractions`` (train, test, validation).

    The FedBNR paper uses 8:1:1. Part sizes are rounded from the cumulative fractions, so they
    sum to N; every part must get at least one row.
    """
    n = np.shape(X)[0]
    if np.shape(y)[0] != n:
        raise ValueError(f"X has {n} rows but y has {np.shape(y)[0]}")
    fractions = np.asarray(fractions, dtype=np.float64)
    if fractions.shape != (3,):
        raise ValueError(f"fractions must be three numbers (train, test, val), got {fractions}")
    if np.any(fractions <= 0) or not np.isclose(fractions.sum(), 1.0):
        raise ValueError(f"fractions must be positive and sum to 1, got {fractions.tolist()}")
    cuts = np.round(np.cumsum(fractions)[:2] * n).astype(int)
    perm = np.random.default_rng(seed).permutation(n)
    parts = [np.sort(p) for p in np.split(perm, cuts)]
    if min(len(p) for p in parts) == 0:
        raise ValueError(f"{n} rows are too few to split into fractions {fractions.tolist()}")
    return Split(*parts)
