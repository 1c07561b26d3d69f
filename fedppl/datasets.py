"""Load regression benchmarks, standardise them and split them into train/test/validation.

:func:`load_uci` reads one folder of the UCI regression benchmarks in the layout of
Hernandez-Lobato & Adams (2015) / Gal & Ghahramani (2016): ``data.txt`` (whitespace-separated),
``index_features.txt``, ``index_target.txt``, ``n_splits.txt`` and ``index_{train,test}_{i}.txt``.
The loader takes a path and assumes nothing about where the data live.

Standardising is scikit-learn's ``StandardScaler`` (:class:`Standardiser` keeps the
original-units API the experiments use). The train/test/validation split stays a seeded NumPy
permutation: scikit-learn's splitters draw from ``RandomState`` and would deal every seed's rows
anew, moving the published FedBNR benchmark figures.

Example (a dataset folder on disk)::

    from fedppl import datasets, partition
    data = datasets.load_uci("path/to/uci/concrete", split=0)
    scaler = datasets.Standardiser.fit(data.X[data.train], data.y[data.train])
    X_tr, y_tr = scaler.transform_X(data.X[data.train]), scaler.transform_y(data.y[data.train])
    clients = partition.paired_chunks(X_tr, y_tr, num_clients=10, seed=0)
    # back to original units: scaler.inverse_transform_y(mean); log-lik: subtract log(y_std)

Splitting (the FedBNR protocol's 8:1:1)::

    >>> import numpy as np
    >>> split = train_test_val_split(np.zeros((10, 2)), np.zeros(10), (0.8, 0.1, 0.1), seed=0)
    >>> [len(part) for part in split]                   # disjoint, sorted row indices
    [8, 1, 1]
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # scikit-learn is imported where a scaler is fitted (it costs ~1 s to load)
    from sklearn.preprocessing import StandardScaler

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


def _read(path: Path, dtype: type) -> np.ndarray:
    """``np.loadtxt`` with the file named in its errors; an empty file gives an empty array."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "loadtxt: input contained no data", UserWarning)
        try:
            return np.loadtxt(path, dtype=dtype, ndmin=2 if dtype is np.float64 else 1)
        except ValueError as e:
            if "number of columns changed" in str(e):  # a ragged table
                raise ValueError(f"{path}: every row must have the same number of columns; "
                                 f"{str(e).split(';')[0]}") from None
            kind = "numbers" if dtype is np.float64 else "integer indices"
            raise ValueError(f"{path} should hold {kind}: {e}") from None


def _indices(folder: Path, name: str) -> np.ndarray:
    return _read(_file(folder, name), np.int64)


def _n_splits(path: Path) -> int:
    """The one positive count in ``n_splits.txt``."""
    counts = _read(path, np.int64)
    if counts.size != 1 or counts[0] < 1:
        raise ValueError(f"{path} should hold one positive number of splits, got "
                         f"{counts.tolist()}")
    return int(counts[0])


def _check_columns(folder: Path, features: np.ndarray, target: np.ndarray, width: int) -> None:
    if features.size == 0:
        raise ValueError(f"{folder / 'index_features.txt'} lists no feature columns")
    if target.size != 1:
        raise ValueError(f"{folder / 'index_target.txt'} should hold one column index, "
                         f"got {target.tolist()}")
    cols = np.append(features, target)
    if cols.min() < 0 or cols.max() >= width:
        raise ValueError(f"column indices {cols.tolist()} out of range for {width} columns "
                         f"in {folder / 'data.txt'}")
    if len(np.unique(features)) != features.size or target[0] in features:
        raise ValueError(f"{folder / 'index_features.txt'} repeats a column or lists the target "
                         f"column {int(target[0])}: {features.tolist()}")


def _check_values(folder: Path, X: np.ndarray, y: np.ndarray) -> None:
    if X.shape[0] == 0:
        raise ValueError(f"{folder / 'data.txt'} holds no rows")
    bad = ~np.isfinite(np.column_stack([X, y]))
    if bad.any():
        rows = np.unique(np.nonzero(bad)[0])
        raise ValueError(f"{folder / 'data.txt'} has NaN or infinite values in {len(rows)} "
                         f"rows (first: {rows[:5].tolist()}); clean or drop them first")


def _check_split(split: int, train: np.ndarray, test: np.ndarray, num_rows: int) -> None:
    for name, idx in (("train", train), ("test", test)):
        if idx.size and (idx.min() < 0 or idx.max() >= num_rows):
            raise ValueError(f"{name} indices of split {split} out of range for {num_rows} rows")
        if len(np.unique(idx)) != idx.size:
            raise ValueError(f"{name} indices of split {split} repeat rows")
    both = np.intersect1d(train, test)
    if both.size:
        raise ValueError(f"train and test indices of split {split} overlap in {both.size} rows "
                         f"(first: {both[:5].tolist()})")


def load_uci(path: str | Path, split: int | None = None) -> UCIData:
    """Read the dataset folder ``path``, with the train/test indices of ``split`` if given.

    Raises ``FileNotFoundError`` (naming the path) for a missing folder or file, and
    ``ValueError`` (naming the file) for an empty ``data.txt`` or rows of different lengths,
    values that are not finite, no feature columns, column indices out of range, a split out of
    range, an empty or malformed ``n_splits.txt``, and train/test indices that are empty, out of
    range, repeated or overlapping.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"UCI dataset folder not found: {folder}")
    data_path = _file(folder, "data.txt")
    data = _read(data_path, np.float64)
    if data.size == 0:
        raise ValueError(f"data.txt at {data_path} is empty (no rows of numbers)")
    features = _indices(folder, "index_features.txt")
    target = _indices(folder, "index_target.txt")
    _check_columns(folder, features, target, data.shape[1])
    X, y = data[:, features], data[:, int(target[0])]
    _check_values(folder, X, y)

    n_path = folder / "n_splits.txt"
    n_splits = _n_splits(n_path) if n_path.is_file() else None
    if split is None:
        return UCIData(X, y, n_splits=n_splits)
    if n_splits is None:
        _file(folder, "n_splits.txt")  # raises, naming the path
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)):
        raise TypeError(f"split must be an integer, got {split!r}")
    if not 0 <= split < n_splits:
        raise ValueError(f"split {split} out of range: {folder} has {n_splits} splits "
                         f"(0 to {n_splits - 1})")
    train = _indices(folder, f"index_train_{split}.txt")
    test = _indices(folder, f"index_test_{split}.txt")
    for name, idx in ((f"index_train_{split}.txt", train), (f"index_test_{split}.txt", test)):
        if idx.size == 0:
            raise ValueError(f"{folder / name} is empty (no row indices)")
    _check_split(split, train, test, X.shape[0])
    return UCIData(X, y, train, test, n_splits)


def _constant_columns(a: np.ndarray) -> np.ndarray:
    return np.ptp(a, axis=0) == 0


def _scaler(a: np.ndarray) -> StandardScaler:
    """sklearn's StandardScaler on the columns of ``a``; an exactly constant column is centred on
    its value (so it maps to exactly 0; sklearn already gives it scale 1: its float std can be
    ~1e-16 rather than 0, as in naval-propulsion-plant, and would blow rounding noise up)."""
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(a)
    const = _constant_columns(a)
    scaler.mean_ = np.where(const, a[0], scaler.mean_)
    scaler.scale_ = np.where(const, 1.0, scaler.scale_)
    return scaler


@dataclass(frozen=True)
class Standardiser:
    """Training moments of ``X`` and ``y``: two fitted ``sklearn.preprocessing.StandardScaler``,
    with the original-units API the experiments use (``y_mean``, ``y_std``,
    :meth:`inverse_transform_y`).

    A constant column maps to exactly 0 (scale 1). Build with :meth:`fit`. A log density of
    standardised ``y`` becomes one of original ``y`` by subtracting ``log(y_std)`` (the
    log-Jacobian of the scaling).

    Example::

        >>> import numpy as np
        >>> s = Standardiser.fit(np.array([[1.0, 5.0], [3.0, 5.0]]), np.array([10.0, 20.0]))
        >>> s.transform_X([[2.0, 5.0]]).tolist(), s.y_mean, s.y_std
        ([[0.0, 0.0]], 15.0, 5.0)
        >>> s.inverse_transform_y(s.transform_y([12.0])).tolist()
        [12.0]
    """

    x: StandardScaler
    y: StandardScaler
    y_is_vector: bool = True

    @classmethod
    def fit(cls, X: np.ndarray, y: np.ndarray) -> Standardiser:
        """Moments of the training arrays ``X`` (N, D) and ``y`` (N,) or (N, K)."""
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if X.ndim != 2 or y.ndim not in (1, 2) or X.shape[0] != y.shape[0] or X.shape[0] == 0:
            raise ValueError(f"need X of shape (N, D) and y of shape (N,) with N > 0, "
                             f"got {X.shape} and {y.shape}")
        for name, a in (("X", X), ("y", y)):
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{name} has NaN or infinite values")
        return cls(_scaler(X), _scaler(y.reshape(len(y), -1)), y.ndim == 1)

    @property
    def x_mean(self) -> np.ndarray:
        return self.x.mean_

    @property
    def x_std(self) -> np.ndarray:
        return self.x.scale_

    @property
    def y_mean(self) -> np.ndarray | float:
        return float(self.y.mean_[0]) if self.y_is_vector else self.y.mean_

    @property
    def y_std(self) -> np.ndarray | float:
        return float(self.y.scale_[0]) if self.y_is_vector else self.y.scale_

    def transform_X(self, X: np.ndarray) -> np.ndarray:
        return self.x.transform(np.asarray(X, dtype=np.float64))

    def _y(self, fn, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=np.float64)
        out = fn(y.reshape(len(y), -1))
        return out.reshape(y.shape)

    def transform_y(self, y: np.ndarray) -> np.ndarray:
        return self._y(self.y.transform, y)

    def inverse_transform_y(self, y: np.ndarray) -> np.ndarray:
        """Standardised ``y`` (or a predictive mean) back in original units."""
        return self._y(self.y.inverse_transform, y)


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
