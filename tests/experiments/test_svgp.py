"""``fedppl svgp`` end to end on a tiny synthetic folder in the UCI layout."""

from __future__ import annotations

import numpy as np
import pytest

from fedppl.cli import main
from fedppl_experiments import svgp
from tests.test_cli import assert_cli_json


def uci_folder(path, n=60, d=2, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, d))
    y = 10.0 + 3.0 * np.sin(X[:, 0]) + 0.1 * rng.normal(size=n)
    np.savetxt(path / "data.txt", np.column_stack([X, y]))
    np.savetxt(path / "index_features.txt", np.arange(d), fmt="%d")
    np.savetxt(path / "index_target.txt", [d], fmt="%d")
    np.savetxt(path / "n_splits.txt", [1], fmt="%d")
    perm = rng.permutation(n)
    np.savetxt(path / "index_train_0.txt", np.sort(perm[: n - 10]), fmt="%d")
    np.savetxt(path / "index_test_0.txt", np.sort(perm[n - 10:]), fmt="%d")
    return path


def test_cli_fits_scores_and_writes_json(tmp_path, capsys):
    folder = uci_folder(tmp_path)
    out = tmp_path / "tvgp.json"
    assert main(["svgp", "--data", str(folder), "--method", "tvgp", "--m0", "4", "--q0", "2",
                 "--batch-size", "10", "--steps", "300", "--lr", "0.05", "--json", str(out),
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "| tvgp |" in text
    (run,) = assert_cli_json(out, "svgp")
    row, loss = run["summary"], run["history"]["loss"]
    assert run["method"] == "tvgp" and run["config"]["m0"] == 4
    assert row["num_inducing"] == 16 and row["num_train"] == 50
    # target in original units has sd ~2: a fit explains most of it, RMSE in both units agree
    assert row["rmse"] < 0.5
    assert abs(row["rmse_original"] / row["rmse"] - np.std(np.loadtxt(
        folder / "data.txt")[:, 2][np.loadtxt(folder / "index_train_0.txt", dtype=int)])) < 0.2
    assert loss[-1] < loss[0] and run["history"]["step"][:2] == [1, 4] and len(loss) == 100


def test_methods_build_their_guides():
    from fedppl.guides import kronecker, rnvgp
    from fedppl.guides import svgp as dense

    X = np.random.default_rng(0).normal(size=(30, 3))
    s = svgp.Settings(num_inducing=40, m0=4, q0=2, terms=2, probes=3, tol=1e-5, roulette=0.2)
    kinds = {"svigp": dense.SVIGPGuide, "diag": dense.DiagGuide, "rnvgp": rnvgp.RNVGPGuide,
             "kron": kronecker.KroneckerGuide, "tvgp": kronecker.TuckerGuide,
             "sumkron": kronecker.SumKroneckerGuide}
    for method, kind in kinds.items():
        model, guide = svgp.build(method, X, s)
        assert type(guide) is kind
        assert model.num_inducing == (64 if method in svgp.GRID_METHODS else 30)
    assert guide.terms == 2
    _, rn = svgp.build("rnvgp", X, s)
    assert (rn.config.probes, rn.config.tol, rn.config.roulette) == (3, 1e-5, 0.2)
    assert svgp.build("svigp", X, s)[0].inducing.learn
    assert not svgp.build("diag", X, s)[0].inducing.learn


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'gp'"):
        svgp.build("gp", np.zeros((3, 2)), svgp.Settings())
    for argv in (["--data", str(tmp_path / "missing"), "--method", "tvgp"],
                 ["--data", str(tmp_path), "--method", "kronecker"]):
        with pytest.raises(SystemExit) as info:
            main(["svgp", *argv])
        assert info.value.code == 2
