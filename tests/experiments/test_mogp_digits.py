from __future__ import annotations

import numpy as np
import pytest

from fedppl_experiments import mogp_digits as md


def test_clients_have_paired_tasks_and_disjoint_images():
    datas, tests = md.make_clients(shots=5, num_clients=4, seed=1, test_per_client=7)
    X, yr, yc = md.load()
    assert len(datas) == 4 and all(int(d.mask.sum()) == 10 for d in datas)
    for d in datas:
        t = np.asarray(d.task)
        assert (t == 0).sum() == 5 and (t == 1).sum() == 5
        assert set(np.unique(np.asarray(d.y)[t == 1])) <= {0.0, 1.0}
    # the regression target and the label agree: label 1 <=> digit >= 5 <=> target > 0
    assert np.all((yr > 0) == (yc == 1))
    rows = np.concatenate([np.asarray(d.X) for d in datas] + [t[0] for t in tests])
    assert len(np.unique(rows, axis=0)) >= len(rows) - 5  # digits has a few duplicate images
    with pytest.raises(ValueError, match="needs"):
        md.make_clients(shots=50, num_clients=30)


def test_pfedmul_learns_on_digits():
    res = md.run("pfed-mul", shots=10, num_clients=6, rounds=6, seed=0)
    assert len(res["acc_curve"]) == 6
    assert res["accuracy"] > 0.6          # chance is ~0.5
    assert res["mse"] < 1.0               # the target has unit variance
    assert 0.0 <= res["ece"] <= 1.0
