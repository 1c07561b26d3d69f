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
    for k in (0, 3, 9):  # one client's padded arrays and mask, on the host
        (Xk, yk), mk = c.padded(k)
        assert isinstance(Xk, np.ndarray) and isinstance(mk, np.ndarray)
        np.testing.assert_array_equal(Xk, Xs[k])
        np.testing.assert_array_equal(yk, ys[k])
        np.testing.assert_array_equal(mk, c.mask[k])


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
    with pytest.raises(ValueError, match="alpha must be a positive"):
        partition.dirichlet(X, y, 3, alpha=0.0)
    with pytest.raises(ValueError, match="clients but only"):
        partition.homogeneous(X[:3], y[:3], 5)


def test_pooled_and_subset(xy):
    X, y = xy
    c = partition.homogeneous(X, y, 4)
    p = c.pooled()
    assert p.num_clients == 1 and p.sizes[0] == 103
    assert c.subset([1, 3]).names == ("client 1", "client 3")


def _chunk_ids(c, X, feature, num_chunks):
    """For each client, the chunk numbers (of ``num_chunks`` sorted chunks) its rows fall in."""
    ranks = np.argsort(np.argsort(X[:, feature], kind="stable"), kind="stable")
    rank_of = dict(zip(X[:, feature].tolist(), ranks.tolist(), strict=False))
    bounds = np.cumsum([len(a) for a in np.array_split(np.arange(len(X)), num_chunks)])
    return [np.searchsorted(bounds, [rank_of[v] for v in d[0][:, feature]], side="right")
            for d in c.data]


def test_paired_chunks_gives_each_client_two_sorted_chunks(xy):
    X, y = xy
    K = 5
    c = partition.paired_chunks(X, y, K, seed=0)  # feature 2 is the most correlated with y
    assert c.num_clients == K and c.sizes.sum() == 103
    rows = np.sort(np.concatenate([d[0][:, 0] for d in c.data]))
    np.testing.assert_array_equal(rows, np.sort(X[:, 0]))  # every row exactly once
    sizes = [len(a) for a in np.array_split(np.arange(103), 2 * K)]
    ids = _chunk_ids(c, X, 2, 2 * K)
    seen = []
    for k, chunk in enumerate(ids):
        pair = np.unique(chunk)
        assert len(pair) == 2, f"client {k} has chunks {pair}"
        assert c.sizes[k] == sizes[pair[0]] + sizes[pair[1]]  # whole chunks, nothing else
        seen.extend(pair.tolist())
    assert sorted(seen) == list(range(2 * K))  # pairs drawn without replacement
    y_of = dict(zip(X[:, 2].tolist(), y.tolist(), strict=False))  # rows keep their targets
    assert all(y_of[x] == v for d in c.data
               for x, v in zip(d[0][:, 2].tolist(), d[1].tolist(), strict=True))


def test_paired_chunks_seed_and_feature(xy):
    X, y = xy

    def pairing(c, feature=2):
        return [tuple(np.unique(i)) for i in _chunk_ids(c, X, feature, 8)]

    a, b = partition.paired_chunks(X, y, 4, seed=3), partition.paired_chunks(X, y, 4, seed=3)
    for da, db in zip(a.data, b.data, strict=False):
        np.testing.assert_array_equal(da[0], db[0])
    pairings = {tuple(pairing(partition.paired_chunks(X, y, 4, seed=s))) for s in range(5)}
    assert len(pairings) > 1  # different seeds, different pairings
    f = partition.paired_chunks(X, y, 4, seed=0, feature=0)
    assert all(len(p) == 2 for p in pairing(f, feature=0))
    assert not all(len(p) == 2 for p in pairing(f, feature=2))


def test_paired_chunks_needs_two_points_per_client(xy):
    X, y = xy
    c = partition.paired_chunks(X[:10], y[:10], 5)
    np.testing.assert_array_equal(c.sizes, [2] * 5)
    with pytest.raises(ValueError, match="6 clients need at least 12 data points"):
        partition.paired_chunks(X[:10], y[:10], 6)
    with pytest.raises(ValueError, match="num_clients must be at least 1"):
        partition.paired_chunks(X, y, 0)
    with pytest.raises(ValueError, match="feature 4 out of range"):
        partition.paired_chunks(X, y, 2, feature=4)


@pytest.mark.parametrize("num_clients,error,match", [
    (2.5, TypeError, "num_clients must be a whole number, got 2.5"),
    ("3", TypeError, "num_clients must be a whole number"),
    (True, TypeError, "num_clients must be a whole number"),
    (0, ValueError, "num_clients must be at least 1"),
    (200, ValueError, "200 clients but only 103 data points"),
])
@pytest.mark.parametrize("split", [partition.homogeneous, partition.by_feature,
                                   partition.paired_chunks])
def test_num_clients_must_be_a_whole_number(xy, split, num_clients, error, match):
    X, y = xy
    with pytest.raises(error, match=match):
        split(X, y, num_clients)


@pytest.mark.parametrize("call,error,match", [
    (lambda X, y: partition.by_feature(X[:, 0], y, 2), ValueError, r"needs X of shape \(N, D\)"),
    (lambda X, y: partition.by_feature(X, y, 2, feature=1.0), TypeError, "column index"),
    (lambda X, y: partition.by_feature(X, y, 2, sizes=[50.5, 52.5]), ValueError,
     "positive whole numbers summing to 103"),
    (lambda X, y: partition.dirichlet(X, y > 0, 2, alpha=float("nan")), ValueError,
     "alpha must be a positive finite number"),
])
def test_other_bad_partition_arguments(xy, call, error, match):
    with pytest.raises(error, match=match):
        call(*xy)
