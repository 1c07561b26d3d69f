from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedppl import datasets, partition

UCI = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci"


def uci(name: str) -> Path:
    folder = UCI / name
    if not folder.is_dir():
        pytest.skip(f"UCI data not found at {folder} (expects ../shared/data/uci beside the repo)")
    return folder


def write_dataset(
    folder: Path, data: np.ndarray, splits: list[tuple[list[int], list[int]]]
) -> Path:
    folder.mkdir()
    np.savetxt(folder / "data.txt", data, delimiter="\t")
    with open(folder / "data.txt", "a") as f:
        f.write("\n")  # a trailing blank line, as in concrete/energy/yacht
    D = data.shape[1] - 1
    (folder / "index_features.txt").write_text("".join(f"{i}\n" for i in range(D)))
    (folder / "index_target.txt").write_text(f"{D}\n")
    (folder / "n_splits.txt").write_text(f"{len(splits)}\n")
    for i, (train, test) in enumerate(splits):
        (folder / f"index_train_{i}.txt").write_text("".join(f"{j}\n" for j in train))
        (folder / f"index_test_{i}.txt").write_text("".join(f"{j}\n" for j in test))
    return folder


def test_concrete_shapes_and_split():
    data = datasets.load_uci(uci("concrete"), split=0)
    assert data.X.shape == (1030, 8) and data.y.shape == (1030,)
    assert data.X.dtype == np.float64 and data.y.dtype == np.float64
    assert data.n_splits == 20
    assert len(np.intersect1d(data.train, data.test)) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([data.train, data.test])), np.arange(1030))
    whole = datasets.load_uci(str(uci("concrete")))
    assert whole.train is None and whole.test is None and whole.n_splits == 20
    np.testing.assert_array_equal(whole.y, data.y)


def test_power_plant_shapes():
    data = datasets.load_uci(uci("power-plant"), split=19)
    assert data.X.shape == (9568, 4) and data.y.shape == (9568,)
    assert len(data.train) + len(data.test) == 9568


def test_standardiser_on_concrete_training_split():
    data = datasets.load_uci(uci("concrete"), split=0)
    Xtr, ytr = data.X[data.train], data.y[data.train]
    s = datasets.Standardiser.fit(Xtr, ytr)
    Z, u = s.transform_X(Xtr), s.transform_y(ytr)
    np.testing.assert_allclose(Z.mean(0), 0, atol=1e-10)
    np.testing.assert_allclose(Z.std(0), 1, atol=1e-10)
    assert abs(u.mean()) < 1e-10 and abs(u.std() - 1) < 1e-10
    assert isinstance(s.y_mean, float) and isinstance(s.y_std, float)
    np.testing.assert_allclose(s.inverse_transform_y(u), ytr)
    clients = partition.paired_chunks(Z, u, num_clients=10, seed=0)
    assert clients.sizes.sum() == len(data.train)


def test_standardiser_constant_column():
    X = np.column_stack([np.arange(5.0), np.full(5, 3.0)])
    s = datasets.Standardiser.fit(X, np.full(5, 2.0))
    np.testing.assert_array_equal(s.x_std, [np.std(np.arange(5.0)), 1.0])
    assert s.y_std == 1.0 and s.y_mean == 2.0
    np.testing.assert_array_equal(s.transform_X(X)[:, 1], 0.0)
    X = np.column_stack([np.arange(1000.0), np.full(1000, 0.998)])  # as in naval-propulsion
    assert X[:, 1].std() > 0  # float rounding: a constant column's std is ~1e-16, not 0
    s = datasets.Standardiser.fit(X, np.arange(1000.0))
    assert s.x_std[1] == 1.0
    np.testing.assert_array_equal(s.transform_X(X)[:, 1], 0.0)
    with pytest.raises(ValueError, match="need X of shape"):
        datasets.Standardiser.fit(X, np.zeros(4))


def test_load_uci_synthetic_folder(tmp_path):
    data = np.arange(24.0).reshape(6, 4)
    folder = write_dataset(tmp_path / "toy", data, [([0, 1, 2, 3], [4, 5]), ([2, 3, 4, 5], [0, 1])])
    d = datasets.load_uci(folder, split=1)
    np.testing.assert_array_equal(d.X, data[:, :3])
    np.testing.assert_array_equal(d.y, data[:, 3])
    np.testing.assert_array_equal(d.test, [0, 1])
    _X, _y, train, _test, n_splits = d
    assert n_splits == 2 and train.dtype == np.int64


def test_load_uci_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        datasets.load_uci(missing)
    folder = write_dataset(tmp_path / "toy", np.ones((4, 3)), [([0, 1], [2, 3])])
    with pytest.raises(ValueError, match=r"split 1 out of range: .* has 1 splits"):
        datasets.load_uci(folder, split=1)
    with pytest.raises(ValueError, match="has 1 splits"):
        datasets.load_uci(folder, split=-1)
    (folder / "index_test_0.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"index_test_0\.txt"):
        datasets.load_uci(folder, split=0)
    (folder / "index_target.txt").write_text("7\n")
    with pytest.raises(ValueError, match="out of range for 3 columns"):
        datasets.load_uci(folder)
    (folder / "data.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"data\.txt"):
        datasets.load_uci(folder)


def test_train_test_val_split():
    X, y = np.zeros((1030, 2)), np.zeros(1030)
    s = datasets.train_test_val_split(X, y, seed=0)
    assert (len(s.train), len(s.test), len(s.val)) == (824, 103, 103)
    np.testing.assert_array_equal(np.sort(np.concatenate(s)), np.arange(1030))  # each row once
    again = datasets.train_test_val_split(X, y, seed=0)
    for a, b in zip(s, again, strict=False):
        np.testing.assert_array_equal(a, b)
    other = datasets.train_test_val_split(X, y, seed=1)
    assert not np.array_equal(s.test, other.test)
    train, test, val = datasets.train_test_val_split(X[:10], y[:10], (0.5, 0.25, 0.25))
    assert (len(train), len(test), len(val)) == (5, 3, 2)  # cuts at round(5), round(7.5)


@pytest.mark.parametrize(
    "fractions", [(0.8, 0.2, 0.0), (0.8, 0.1, 0.2), (0.9, 0.1), (-0.1, 0.6, 0.5)]
)
def test_train_test_val_split_rejects_bad_fractions(fractions):
    with pytest.raises(ValueError, match="fractions must"):
        datasets.train_test_val_split(np.zeros((20, 1)), np.zeros(20), fractions)


def test_train_test_val_split_errors():
    with pytest.raises(ValueError, match="too few"):
        datasets.train_test_val_split(np.zeros((3, 1)), np.zeros(3), (0.9, 0.05, 0.05))
    with pytest.raises(ValueError, match="X has 5 rows but y has 4"):
        datasets.train_test_val_split(np.zeros((5, 1)), np.zeros(4))


def test_standardiser_is_sklearn_with_the_old_numbers():
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    X, y = rng.normal(3.0, 5.0, size=(300, 4)), rng.normal(10.0, 2.0, size=300)
    s = datasets.Standardiser.fit(X, y)
    assert isinstance(s.x, StandardScaler) and isinstance(s.y, StandardScaler)
    # the hand-written standardiser this replaced: (a - a.mean(0)) / a.std(0)
    np.testing.assert_array_equal(s.transform_X(X), (X - X.mean(0)) / X.std(0))
    np.testing.assert_array_equal(s.transform_y(y), (y - y.mean()) / y.std())
    Y = np.column_stack([y, 2 * y])
    s2 = datasets.Standardiser.fit(X, Y)
    assert s2.y_mean.shape == (2,) and s2.transform_y(Y).shape == (300, 2)
    with pytest.raises(ValueError, match="X has NaN"):
        datasets.Standardiser.fit(np.array([[np.nan], [1.0]]), np.ones(2))


def _folder(tmp_path, data=None, features="0\n1\n", splits=None):
    folder = tmp_path / "toy"
    folder.mkdir()
    data = np.arange(12.0).reshape(4, 3) if data is None else data
    np.savetxt(folder / "data.txt", data)
    (folder / "index_features.txt").write_text(features)
    (folder / "index_target.txt").write_text("2\n")
    if splits is not None:
        (folder / "n_splits.txt").write_text(f"{len(splits)}\n")
        for i, (train, test) in enumerate(splits):
            (folder / f"index_train_{i}.txt").write_text("".join(f"{j}\n" for j in train))
            (folder / f"index_test_{i}.txt").write_text("".join(f"{j}\n" for j in test))
    return folder


@pytest.mark.parametrize("kwargs,split,match", [
    (dict(data=np.array([[1.0, np.nan, 2.0], [1.0, 2.0, 3.0]])), None,
     r"NaN or infinite values in 1 rows \(first: \[0\]\)"),
    (dict(data=np.array([[1.0, 2.0, np.inf], [1.0, 2.0, 3.0]])), None, "NaN or infinite"),
    (dict(features=""), None, "lists no feature columns"),
    (dict(features="0\n0\n"), None, "repeats a column or lists the target"),
    (dict(features="0\n2\n"), None, "repeats a column or lists the target"),
    (dict(features="0.5\n"), None, "should hold integer indices"),
    (dict(splits=[([0, 1, 2], [2, 3])]), 0, r"overlap in 1 rows \(first: \[2\]\)"),
    (dict(splits=[([0, 0, 1], [2, 3])]), 0, "train indices of split 0 repeat rows"),
    (dict(splits=[([0, 1], [2, 9])]), 0, "test indices of split 0 out of range"),
])
def test_load_uci_refuses_bad_folders(tmp_path, kwargs, split, match):
    folder = _folder(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=match):
        datasets.load_uci(folder, split=split)


def test_load_uci_refuses_text_and_a_non_integer_split(tmp_path):
    folder = _folder(tmp_path, splits=[([0, 1], [2, 3])])
    with pytest.raises(TypeError, match="split must be an integer"):
        datasets.load_uci(folder, split=0.0)
    (folder / "data.txt").write_text("1 2 3\n4 five 6\n")
    with pytest.raises(ValueError, match=r"data\.txt should hold numbers"):
        datasets.load_uci(folder)
