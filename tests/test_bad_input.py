"""Bad input, across the methods, the CLI and the loader: each case gets a clear error that names
the argument (or the client) and the problem, before any compiled code runs. Nothing bad is
silently accepted."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import fedppl
from fedppl.models import linear_regression, logistic_regression

RNG = np.random.default_rng(0)
X = RNG.normal(size=(40, 3))
Y_REAL = X @ np.ones(3)
Y_BIN = (X[:, 0] > 0) * 1.0
KEY = jax.random.key(0)


def _clients(X=X, y=Y_BIN, k=2):
    return fedppl.partition.homogeneous(X, y, num_clients=k, seed=0)


def _pvi(**kw):
    return fedppl.PVI(logistic_regression, fedppl.PVIGuide(logistic_regression), **kw)


def _run_pvi(clients, **kw):
    return _pvi(local_steps=2, num_particles=4, elbo_samples=0).run(KEY, clients, 1,
                                                                     progress_bar=False, **kw)


def _urk():
    from fedppl.models.random_features import URKSpec

    return URKSpec(input_dim=3, feature_widths=(), shift_widths=(), num_samples=4)


def _mogp():
    from fedppl.models import mogp

    spec = mogp.MOGPSpec(("regression", "classification"), num_latent=1)
    return spec, mogp.init_hyper(spec, 1, W=jnp.ones((2, 1)))


def _uci(tmp: Path, data: str, train="0\n1\n2\n", test="3\n4\n", features="0\n1\n",
         target="2\n") -> Path:
    folder = tmp / "uci"
    folder.mkdir()
    (folder / "data.txt").write_text(data)
    (folder / "n_splits.txt").write_text("1\n")
    for name, text in (("index_train_0.txt", train), ("index_test_0.txt", test),
                       ("index_features.txt", features), ("index_target.txt", target)):
        (folder / name).write_text(text)
    return folder


GOOD_ROWS = "".join(f"{i} {2 * i} {3 * i}\n" for i in range(5))


def exact_gp(X, y=None):
    """An exact GP: one MultivariateNormal over all the data points (does not split)."""
    ls = numpyro.sample("ls", dist.LogNormal(0.0, 1.0))
    d = X[:, None, 0] - X[None, :, 0]
    K = jnp.exp(-0.5 * d**2 / ls**2) + 0.1 * jnp.eye(X.shape[0])
    numpyro.sample("y", dist.MultivariateNormal(jnp.zeros(X.shape[0]), K), obs=y)


def exact_gp_in_plate(X, y=None):
    """The exact GP "fixed" by a data plate: N copies of the whole likelihood, another model."""
    ls = numpyro.sample("ls", dist.LogNormal(0.0, 1.0))
    d = X[:, None, 0] - X[None, :, 0]
    K = jnp.exp(-0.5 * d**2 / ls**2) + 0.1 * jnp.eye(X.shape[0])
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.MultivariateNormal(jnp.zeros(X.shape[0]), K), obs=y)


def kw_linear(*, X, y=None):
    """fedppl.models.linear_regression with keyword-only data arguments."""
    linear_regression(X, y)


def kw_only_X(*, X):
    """A model of one keyword-only data argument, given two arrays per client."""
    linear_regression(X)


def _setup(model, clients):
    """What every NumPyro front does first (PVI, GlobalVI, EP, OneShot, Importance): trace the
    model on one client's data; no round is compiled."""
    return fedppl.PVIGuide(model).setup(*clients.client(0))

# (callable, exception, words the message must contain)
CASES = {
    # -- the clients' data ------------------------------------------------------------------
    "clients-empty-list": (lambda: fedppl.Clients.from_list([]), ValueError, "no clients"),
    "client-no-rows": (lambda: fedppl.Clients.from_list([(X, Y_BIN), (X[:0], Y_BIN[:0])]),
                       ValueError, "client 1 has no data"),
    # SIM300 misreads the upper-case data array X as a constant.
    "client-nan": (lambda: fedppl.Clients.from_list([(np.where(X == X[3, 1], np.nan, X),  # noqa: SIM300
                                                      Y_BIN)]), ValueError, "NaN"),
    "client-inf-labels": (lambda: fedppl.Clients.from_list([(X, np.r_[np.inf, Y_BIN[1:]])]),
                          ValueError, "infinite"),
    "client-rows-differ": (lambda: fedppl.Clients.from_list([(X, Y_BIN[:-1])]), ValueError,
                           "different numbers of rows"),
    "client-arity": (lambda: fedppl.Clients.from_list([(X, Y_BIN), (X,)]), ValueError,
                     "client 1 has 1 arrays"),
    "client-feature-count": (lambda: fedppl.Clients.from_list([(X, Y_BIN), (X[:, :2], Y_BIN)]),
                             ValueError, "differ from client 0"),
    "client-scalar": (lambda: fedppl.Clients.from_list([(np.float64(1.0), Y_BIN)]), ValueError,
                      "leading data axis"),
    # -- partitioners -----------------------------------------------------------------------
    "partition-fractional-clients": (lambda: _clients(k=2.5), TypeError, "num_clients"),
    "partition-zero-clients": (lambda: _clients(k=0), ValueError, "num_clients"),
    "partition-string-clients": (lambda: _clients(k="3"), TypeError, "num_clients"),
    "partition-more-clients-than-rows": (lambda: _clients(k=41), ValueError, "41 clients"),
    "partition-rows-mismatch": (lambda: _clients(y=Y_BIN[:-3]), ValueError, "rows"),
    "dirichlet-alpha": (lambda: fedppl.partition.dirichlet(X, Y_BIN, 2, alpha=0.0), ValueError,
                        "alpha"),
    # -- PVI settings -----------------------------------------------------------------------
    "pvi-damping-zero": (lambda: _pvi(damping=0.0), ValueError, "damping"),
    "pvi-damping-above-one": (lambda: _pvi(damping=1.5), ValueError, "damping"),
    "pvi-conjugate-word": (lambda: _pvi(conjugate="maybe"), ValueError, "conjugate"),
    "pvi-solver-name": (lambda: _pvi(solver="sgd"), ValueError, "solver"),
    "pvi-local-steps": (lambda: _pvi(local_steps=0), ValueError, "local_steps"),
    "pvi-odd-particles": (lambda: _pvi(num_particles=3), ValueError, "num_particles"),
    "pvi-local-tol": (lambda: _pvi(local_tol=-1.0), ValueError, "local_tol"),
    "pvi-shrink-warning": (lambda: _pvi(shrink_warning=0.5), ValueError, "shrink_warning"),
    "pvi-clients-per-round": (lambda: _pvi(clients_per_round=0), ValueError,
                              "clients_per_round"),
    "pvi-string-optimizer": (lambda: _pvi(solver="optax", optimizer="adam"), TypeError,
                             "optimizer"),
    "pvi-schedule": (lambda: _pvi(schedule="parallel").init(KEY, _clients()), ValueError,
                     "schedule"),
    "pvi-labels-outside-support": (lambda: _run_pvi(_clients(y=Y_BIN * 2)), ValueError,
                                   "outside its distribution's support"),
    "pvi-string-labels": (lambda: _run_pvi(_clients(y=np.where(Y_BIN > 0, "yes", "no"))),
                          TypeError, "numbers"),
    "pvi-resume-other-features": (
        lambda: _run_pvi(_clients(X=np.c_[X, X]), factors=_run_pvi(_clients()).factors),
        ValueError, "do not fit"),
    "pvi-tol": (lambda: _pvi().run(KEY, _clients(), 1, tol=0.0), ValueError, "tol"),
    "pvi-seed-for-key": (lambda: _pvi().run(0, _clients(), 1), TypeError, "rng_key"),
    "pvi-rounds-float": (lambda: _pvi().run(KEY, _clients(), 2.5), TypeError, "num_rounds"),
    "pvi-rounds-negative": (lambda: _pvi().run(KEY, _clients(), -2), ValueError, "num_rounds"),
    "pvi-update-before-init": (lambda: _pvi().update(None), RuntimeError, "init"),
    "pvi-arrays-not-clients": (lambda: _pvi().run(KEY, (X, Y_BIN), 1), TypeError, "Clients"),
    "pvi-conjugate-required": (
        lambda: fedppl.PVI(logistic_regression, fedppl.PVIGuide(logistic_regression),
                           conjugate=True).init(KEY, _clients()), ValueError, "not conjugate"),
    "guide-unknown-site": (lambda: fedppl.PVIGuide(linear_regression, ["v"]).setup(X, Y_REAL),
                           ValueError, "v"),
    "guide-family": (lambda: fedppl.PVIGuide(linear_regression, family="diagonal"), ValueError,
                     "family"),
    "globalvi-seed-for-key": (lambda: fedppl.GlobalVI(logistic_regression, fedppl.PVIGuide(
        logistic_regression)).run(None, _clients()), TypeError, "rng_key"),
    # -- FedBNR -------------------------------------------------------------------------------
    "fedbnr-negative-noise": (lambda: fedppl.FedBNR(_urk(), noise=-0.3), ValueError, "noise"),
    "fedbnr-eval-every-zero": (lambda: fedppl.FedBNR(_urk(), eval_every=0), ValueError,
                               "eval_every"),
    "fedbnr-kernel-name": (lambda: fedppl.FedBNR(_urk(), kernel="mean"), ValueError, "kernel"),
    "fedbnr-string-optimizer": (lambda: fedppl.FedBNR(_urk(), optimizer="adam"), TypeError,
                                "optimizer"),
    "fedbnr-1d-X": (lambda: fedppl.FedBNR(_urk()).run(KEY, _clients(X=X[:, :1]), 1),
                    ValueError, "shape"),
    "fedbnr-string-labels": (
        lambda: fedppl.FedBNR(_urk()).run(KEY, fedppl.Clients.from_list(
            [(X, np.where(Y_BIN > 0, "a", "b"))]), 1), TypeError, "numbers"),
    "fedbnr-kd-without-data": (lambda: fedppl.FedBNR(_urk(), kernel="kd").run(
        KEY, _clients(y=Y_REAL), 1, progress_bar=False), ValueError, "kd_data"),
    # -- pFed-Mul -----------------------------------------------------------------------------
    "pfedmul-fraction-above-one": (lambda: fedppl.PFedMul(*_mogp(), fraction=1.5), ValueError,
                                   "fraction"),
    "pfedmul-fraction-zero": (lambda: fedppl.PFedMul(*_mogp(), fraction=0.0), ValueError,
                              "fraction"),
    "pfedmul-variant": (lambda: fedppl.PFedMul(*_mogp(), variant="some"), ValueError,
                        "variant"),
    "pfedmul-string-optimizer": (lambda: fedppl.PFedMul(*_mogp(), optimizer="sgd"), TypeError,
                                 "optimizer"),
    "pfedmul-inducing": (lambda: fedppl.PFedMul(*_mogp(), num_inducing=0), ValueError,
                         "num_inducing"),
    # -- co-training --------------------------------------------------------------------------
    "cotraining-combination": (lambda: fedppl.CoTraining("sum"), ValueError, "combination"),
    "cotraining-uncertainty": (lambda: fedppl.CoTraining("noisy", "some"), ValueError,
                               "uncertainty"),
    "cotraining-fit-steps": (lambda: fedppl.CoTraining(fit_steps=0), ValueError, "fit_steps"),
    "cotraining-string-optimizer": (lambda: fedppl.CoTraining(optimizer=0.1), TypeError,
                                    "optimizer"),
    # -- the UCI loader -----------------------------------------------------------------------
    "uci-missing-folder": (lambda tmp: fedppl.datasets.load_uci(tmp / "nowhere", 0),
                           FileNotFoundError, "nowhere"),
    "uci-nan": (lambda tmp: fedppl.datasets.load_uci(_uci(tmp, GOOD_ROWS.replace("6", "nan")),
                                                     0), ValueError, "NaN"),
    "uci-no-features": (lambda tmp: fedppl.datasets.load_uci(_uci(tmp, GOOD_ROWS, features=""),
                                                             0), ValueError, "feature"),
    "uci-overlapping-split": (lambda tmp: fedppl.datasets.load_uci(
        _uci(tmp, GOOD_ROWS, test="2\n3\n"), 0), ValueError, "overlap"),
    "uci-not-numbers": (lambda tmp: fedppl.datasets.load_uci(
        _uci(tmp, GOOD_ROWS.replace("6", "six")), 0), ValueError, "data.txt"),
    "uci-index-out-of-range": (lambda tmp: fedppl.datasets.load_uci(
        _uci(tmp, GOOD_ROWS, test="3\n9\n"), 0), ValueError, "out of range"),
    "uci-missing-split": (lambda tmp: fedppl.datasets.load_uci(_uci(tmp, GOOD_ROWS), 4),
                          ValueError, "split 4 out of range"),
    # -- issue 36's remaining obscure errors ------------------------------------------------
    # 1-D X: the model's IndexError, with the argument, its shape and the fix
    "model-1d-X": (lambda: _run_pvi(_clients(X=X[:, 0])), IndexError,
                   "X (20,), y (20,)): IndexError: tuple index out of range. X is 1-D"),
    "model-1d-X-hint": (lambda: _setup(logistic_regression, _clients(X=X[:, 0])), IndexError,
                        "use X[:, None] for one feature"),
    "globalvi-1d-X": (lambda: fedppl.GlobalVI(logistic_regression, fedppl.PVIGuide(
        logistic_regression)).run(KEY, _clients(X=X[:, 0]), progress_bar=False), IndexError,
                      "X[:, None]"),
    "sgp-1d-X": (lambda: fedppl.FederatedSGP().run(KEY, _clients(X=X[:, 0], y=Y_REAL), 1),
                 ValueError, "client 0: X must have shape (N, D), got (20,): use X[:, None]"),
    "fsgp-1d-X": (lambda: fedppl.FSGP().run(KEY, _clients(X=X[:, 0], y=Y_REAL), 1), ValueError,
                  "client 0: X must have shape (N, D), got (20,): use X[:, None]"),
    "by-feature-1d-X": (lambda: fedppl.partition.by_feature(X[:, 0], Y_REAL, 2), ValueError,
                        "X[:, None]"),
    # y of shape (N, 1): refused (not squeezed), naming the site and the argument
    "model-y-column": (lambda: _run_pvi(_clients(y=Y_BIN[:, None])), ValueError,
                       "observed site 'y' (the model's argument y) has shape (20, 1)"),
    "model-y-column-hint": (lambda: _setup(linear_regression, _clients(y=Y_REAL[:, None])),
                            ValueError, "pass y of shape (20,) (y.reshape(-1)"),
    "sgp-y-column": (lambda: fedppl.FederatedSGP().run(KEY, _clients(y=Y_REAL[:, None]), 1),
                     ValueError, "client 0: need y of shape (N,), got (20, 1)"),
    "fsgp-y-column": (lambda: fedppl.FSGP().run(KEY, _clients(y=Y_REAL[:, None]), 1),
                      ValueError, "y.reshape(-1)"),
    # keyword-only data arguments are supported (test below); more arrays than arguments is not
    "kw-model-too-many-arrays": (lambda: _setup(kw_only_X, _clients(y=Y_REAL)), TypeError,
                                 "keyword-only arguments ['X'], but was given 2 data arrays"),
    # an exact GP does not split over clients, with or without a data plate
    "exact-gp": (lambda: fedppl.PVI(exact_gp, fedppl.PVIGuide(exact_gp)).init(
        KEY, _clients(y=Y_REAL)), ValueError,
        "observed site 'y' (the model's argument y) is one MultivariateNormal over all 20 data "
        "points (event shape (20,)): this likelihood couples every data point, so it does not "
        "split over clients"),
    "exact-gp-sparse-advice": (lambda: _setup(exact_gp, _clients(y=Y_REAL)), ValueError,
                               "fedppl.FederatedSGP or fedppl.FSGP"),
    "exact-gp-in-data-plate": (lambda: _setup(exact_gp_in_plate, _clients(y=Y_REAL)), ValueError,
                               "inside the data plate it is 20 copies of that likelihood"),
    "client-handler-exact-gp": (lambda: numpyro.handlers.trace(numpyro.handlers.seed(
        fedppl.handlers.client(exact_gp, mask=jnp.ones(40, bool)), 0)).get_trace(X, Y_REAL),
        ValueError, "over all 40 data points (event shape (40,)): it couples every data point"),
    # malformed UCI folders: the file named
    "uci-empty-data": (lambda tmp: fedppl.datasets.load_uci(_uci(tmp, ""), 0), ValueError,
                       "data.txt at "),
    "uci-blank-data": (lambda tmp: fedppl.datasets.load_uci(_uci(tmp, "\n\n"), 0), ValueError,
                       "uci/data.txt is empty"),
    "uci-ragged-rows": (lambda tmp: fedppl.datasets.load_uci(_uci(tmp, GOOD_ROWS + "5 10\n"), 0),
                        ValueError, "data.txt: every row must have the same number of columns"),
    "uci-empty-train-index": (lambda tmp: fedppl.datasets.load_uci(_uci(tmp, GOOD_ROWS, train=""),
                                                                   0), ValueError,
                              "index_train_0.txt is empty"),
    "uci-empty-n-splits": (lambda tmp: _uci_n_splits(tmp, ""), ValueError, "n_splits.txt"),
    "uci-zero-n-splits": (lambda tmp: _uci_n_splits(tmp, "0\n"), ValueError,
                          "one positive number of splits"),
}

def _uci_n_splits(tmp: Path, text: str):
    folder = _uci(tmp, GOOD_ROWS)
    (folder / "n_splits.txt").write_text(text)
    return fedppl.datasets.load_uci(folder, 0)


# fedppl <flags> -> argparse refuses, naming the flag
CLI = {
    "demo-zero-clients": (["demo", "--clients", "0"], "--clients"),
    "demo-rounds-negative": (["demo", "--rounds", "-1"], "--rounds"),
    "demo-local-steps-float": (["demo", "--local-steps", "2.5"], "--local-steps"),
    "fedbnr-rounds-zero": (["fedbnr", "--data", ".", "--rounds", "0"], "--rounds"),
    "fedbnr-kd-alpha": (["fedbnr", "--data", ".", "--kd-alpha", "-1"], "--kd-alpha"),
    "fedbnr-no-data": (["fedbnr"], "--data"),
    "cotrain-combination": (["cotrain", "--combination", "sum"], "--combination"),
    "unknown-command": (["fit"], "invalid choice"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_a_clear_error(case, tmp_path):
    fn, error, words = CASES[case]
    call = (lambda: fn(tmp_path)) if fn.__code__.co_argcount else fn
    with pytest.raises(error) as info:
        call()
    assert words.lower() in str(info.value).lower(), str(info.value)


@pytest.mark.parametrize("case", list(CLI))
def test_bad_flags_are_refused_by_the_cli(case, capsys):
    from fedppl.cli import main

    argv, flag = CLI[case]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_there_are_at_least_sixty_cases():
    assert len(CASES) + len(CLI) >= 60


def test_nothing_is_computed_for_a_refused_client():
    """A client with bad labels is named before the first round: no state was built."""
    pvi = _pvi(local_steps=2, num_particles=4, elbo_samples=0)
    before = dict(vars(pvi))
    with pytest.raises(ValueError, match="client"):
        pvi.init(KEY, _clients(y=Y_BIN * 2))
    # the method object is as it was: a run's state lives in its RunState, never on the method
    assert vars(pvi).keys() == before.keys()
    assert all(vars(pvi)[k] is v for k, v in before.items())
    assert optax  # the good optimiser path is exercised by the front tests


def test_keyword_only_data_arguments_are_supported():
    """``def kw_linear(*, X, y=None)``: the clients' arrays go to its keyword-only parameters in
    order, and the run is the positional model's exactly (the conjugate step, one round)."""
    clients = _clients(y=Y_REAL)
    runs = [fedppl.PVI(m, fedppl.PVIGuide(m, family="fullrank")).run(KEY, clients, 1,
                                                                    progress_bar=False)
            for m in (linear_regression, kw_linear)]
    for a, b in zip(jax.tree.leaves(runs[0].factors), jax.tree.leaves(runs[1].factors),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    pred = runs[1].predictive(jax.random.key(1), X[:5], num_samples=3)["y"]
    assert pred.shape == (3, 5)
