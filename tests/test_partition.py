from __future__ import annotations

import numpy as np
import pytest

import fedppl
from fedppl import partition


@pytest.fixture
def xy():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(103, 4))
    y = X[:, 2] * 3 + 0.1 * rng.normal(size=103)
    return X, y


def test_homogeneous_covers_every_row_once(xy):
    X, y = xy
    c = partition.homogeneous(X, y, 10, seed=1)
    assert c.num_clients == 10 and c.sizes.sum() == 103 and c.sizes.max() - c.sizes.min() <= 1
    rows = np.sort(np.concatenate([d[0][:, 0] for d in c.data]))
    np.testing.assert_array_equal(rows, np.sort(X[:, 0]))
    Xs, ys = c.stacked
    assert Xs.shape == (10, 11, 4) and ys.shape == (10, 11)
    assert int(c.mask.sum()) == 103
    assert np.all(np.asarray(Xs)[~np.asarray(c.mask)] == 0)


def test_by_feature_sorts_by_the_most_correlated_feature(xy):
    X, y = xy
    c = partition.by_feature(X, y, 4)
    maxes = [d[0][:, 2].max() for d in c.data]
    mins = [d[0][:, 2].min() for d in c.data]
    assert all(maxes[k] <= mins[k + 1] for k in range(3))
    u = partition.by_feature(X, y, 3, feature=0, sizes=[3, 50, 50])
    np.testing.assert_array_equal(u.sizes, [3, 50, 50])


def test_by_group_and_dirichlet(xy):
    X, y = xy
    groups = np.arange(103) % 3
    c = partition.by_group(X, y, groups)
    assert c.names == ("group 0", "group 1", "group 2")
    labels = (y > 0).astype(int)
    d = partition.dirichlet(X, labels, 5, alpha=0.3, seed=0)
    assert d.sizes.sum() == 103 and d.sizes.min() >= 1
    skew = [np.mean(part[1]) for part in d.data]
    assert max(skew) - min(skew) > 0.3  # label skew at small alpha


def test_bad_input_names_the_problem(xy):
    X, y = xy
    with pytest.raises(ValueError, match="X has 103 rows but y has 50"):
        partition.homogeneous(X, y[:50], 2)
    with pytest.raises(ValueError, match="client 1 has no data"):
        partition.from_indices(X, y, [[0, 1], []])
    bad = X.copy()
    bad[60, 1] = np.nan
    with pytest.raises(ValueError, match=r"client \d: array 0 has NaN or infinite values"):
        partition.by_feature(bad, y, 4, feature=0)
    with pytest.raises(ValueError, match="client 1: arrays have different numbers of rows"):
        fedppl.Clients.from_list([(X[:5], y[:5]), (X[:5], y[:4])])
    with pytest.raises(ValueError, match="client 1: array shapes"):
        fedppl.Clients.from_list([(X[:5], y[:5]), (X[:5, :2], y[:5])])
    with pytest.raises(ValueError, match="alpha must be positive"):
        partition.dirichlet(X, y, 3, alpha=0.0)
    with pytest.raises(ValueError, match="clients but only"):
        partition.homogeneous(X[:3], y[:3], 5)


def test_pooled_and_subset(xy):
    X, y = xy
    c = partition.homogeneous(X, y, 4)
    p = c.pooled()
    assert p.num_clients == 1 and p.sizes[0] == 103
    assert c.subset([1, 3]).names == ("client 1", "client 3")
