"""Bad input to the Pyro port: the NumPyro core's cases (``tests/test_bad_input.py``) for PVI,
PVIGuide and GlobalVI, with the same exception and the same message, before anything runs.

Where the message names something that is not the same in the two PPLs (a ``torch.Generator``
for a JAX key, a torch optimiser for an optax one, the ``"optim"`` solver for ``"optax"``, the
port's schedules), the case checks the words the core's case checks; everywhere else the message
is compared with the core's own, character for character. The clients' and partitioners' cases
are shared code (``fedppl.Clients``, ``fedppl.partition``), tested once in the core's file.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import fedppl
import fedppl.pyro as fp
from fedppl.models import linear_regression as linear_np
from fedppl.models import logistic_regression as logistic_np
from fedppl.pyro.models import linear_regression as linear_py
from fedppl.pyro.models import logistic_regression as logistic_py

RNG = np.random.default_rng(0)
X = RNG.normal(size=(40, 3))
Y_REAL = X @ np.ones(3)
Y_BIN = (X[:, 0] > 0) * 1.0
JKEY = jax.random.key(0)


def tkey():
    return torch.Generator().manual_seed(0)


def _clients(X=X, y=Y_BIN, k=2):
    return fedppl.partition.homogeneous(X, y, num_clients=k, seed=0)


def _np(**kw):
    return fedppl.PVI(logistic_np, fedppl.PVIGuide(logistic_np), **kw)


def _py(**kw):
    return fp.PVI(logistic_py, fp.PVIGuide(logistic_py), **kw)


def _run_np(clients, **kw):
    return _np(local_steps=2, num_particles=4, elbo_samples=0).run(JKEY, clients, 1,
                                                                    progress_bar=False, **kw)


def _run_py(clients, **kw):
    return _py(local_steps=2, num_particles=4, elbo_samples=0).run(tkey(), clients, 1,
                                                                    progress_bar=False, **kw)


# case -> (the port's call, the core's call or None (words only), exception, words)
CASES = {
    "pvi-damping-zero": (lambda: _py(damping=0.0), lambda: _np(damping=0.0), ValueError,
                         "damping"),
    "pvi-damping-above-one": (lambda: _py(damping=1.5), lambda: _np(damping=1.5), ValueError,
                              "damping"),
    "pvi-conjugate-word": (lambda: _py(conjugate="maybe"), lambda: _np(conjugate="maybe"),
                           ValueError, "conjugate"),
    "pvi-solver-name": (lambda: _py(solver="sgd"), None, ValueError, "solver"),
    "pvi-local-steps": (lambda: _py(local_steps=0), lambda: _np(local_steps=0), ValueError,
                        "local_steps"),
    "pvi-odd-particles": (lambda: _py(num_particles=3), lambda: _np(num_particles=3),
                          ValueError, "num_particles"),
    "pvi-local-tol": (lambda: _py(local_tol=-1.0), lambda: _np(local_tol=-1.0), ValueError,
                      "local_tol"),
    "pvi-shrink-warning": (lambda: _py(shrink_warning=0.5), lambda: _np(shrink_warning=0.5),
                           ValueError, "shrink_warning"),
    "pvi-clients-per-round": (lambda: _py(clients_per_round=0),
                              lambda: _np(clients_per_round=0), ValueError,
                              "clients_per_round"),
    "pvi-max-divergence": (lambda: _py(max_divergence=0.0), lambda: _np(max_divergence=0.0),
                           ValueError, "max_divergence"),
    "pvi-string-optimizer": (lambda: _py(solver="optim", optimizer="adam"), None, TypeError,
                             "optimizer"),
    "pvi-schedule": (lambda: _py(schedule="parallel").init(tkey(), _clients()), None,
                     ValueError, "schedule"),
    "pvi-labels-outside-support": (lambda: _run_py(_clients(y=Y_BIN * 2)),
                                   lambda: _run_np(_clients(y=Y_BIN * 2)), ValueError,
                                   "outside its distribution's support"),
    "pvi-resume-other-features": (
        lambda: _run_py(_clients(X=np.c_[X, X]), factors=_run_py(_clients()).factors), None,
        ValueError, "do not fit"),
    "pvi-tol": (lambda: _py().run(tkey(), _clients(), 1, tol=0.0),
                lambda: _np().run(JKEY, _clients(), 1, tol=0.0), ValueError, "tol"),
    "pvi-seed-for-key": (lambda: _py().run(0, _clients(), 1), None, TypeError, "rng_key"),
    "pvi-rounds-float": (lambda: _py().run(tkey(), _clients(), 2.5),
                         lambda: _np().run(JKEY, _clients(), 2.5), TypeError, "num_rounds"),
    "pvi-rounds-negative": (lambda: _py().run(tkey(), _clients(), -2),
                            lambda: _np().run(JKEY, _clients(), -2), ValueError, "num_rounds"),
    "pvi-update-before-init": (lambda: _py().update(None), lambda: _np().update(None),
                               RuntimeError, "init"),
    "pvi-arrays-not-clients": (lambda: _py().run(tkey(), (X, Y_BIN), 1),
                               lambda: _np().run(JKEY, (X, Y_BIN), 1), TypeError, "Clients"),
    # words only: the message names each PPL's distribution class (Bernoulli, BernoulliLogits)
    "pvi-conjugate-required": (
        lambda: fp.PVI(logistic_py, fp.PVIGuide(logistic_py), conjugate=True).init(
            tkey(), _clients()), None, ValueError, "not conjugate: observed site 'y' is"),
    "pvi-polya-gamma-labels": (
        lambda: fp.PVI(logistic_py, fp.PVIGuide(logistic_py), conjugate="polya-gamma").init(
            tkey(), _clients(y=2 * Y_BIN - 1)),
        lambda: fedppl.PVI(logistic_np, fedppl.PVIGuide(logistic_np),
                           conjugate="polya-gamma").init(JKEY, _clients(y=2 * Y_BIN - 1)),
        ValueError, "client 0"),
    "guide-unknown-site": (lambda: fp.PVIGuide(linear_py, ["v"]).setup(X, Y_REAL),
                           lambda: fedppl.PVIGuide(linear_np, ["v"]).setup(X, Y_REAL),
                           ValueError, "v"),
    "guide-family": (lambda: fp.PVIGuide(linear_py, family="diagonal"),
                     lambda: fedppl.PVIGuide(linear_np, family="diagonal"), ValueError,
                     "family"),
    "globalvi-seed-for-key": (lambda: fp.GlobalVI(logistic_py, fp.PVIGuide(logistic_py)).run(
        None, _clients()), None, TypeError, "rng_key"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_the_cores_error(case):
    ours, theirs, error, words = CASES[case]
    with pytest.raises(error) as info:
        ours()
    assert words.lower() in str(info.value).lower(), str(info.value)
    if theirs is not None:
        with pytest.raises(error) as core:
            theirs()
        assert str(info.value) == str(core.value)


def test_nothing_is_computed_for_a_refused_client():
    pvi = _py(local_steps=2, num_particles=4, elbo_samples=0)
    with pytest.raises(ValueError, match="client 0: observed site 'y'"):
        pvi.init(tkey(), _clients(y=Y_BIN * 2))
    assert not hasattr(pvi, "_run")
