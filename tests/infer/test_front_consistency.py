"""One front in fact: every method's ``run`` shows a progress bar with a finite quantity (none
with ``progress_bar=False``), a run stopped early writes one line that stays, ``tol`` is a
``run`` argument wherever a method stops by it, and the silent settings of review are errors
that name the argument.

Each method runs once with its bar on (module-scoped: its compiled rounds are reused by the
run with the bar off), on a tiny problem for a few rounds.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedppl
from fedppl.infer.base import Result
from fedppl.infer.round_log import postfix
from fedppl.models import linear_regression as linear
from tests.infer.test_front import METHODS as FRONT


def _linear_clients(num_clients: int = 3):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = X @ np.array([1.0, -0.5]) + 0.5 * rng.normal(size=60)
    return fedppl.partition.homogeneous(X, y, num_clients=num_clients, seed=0)


def _guide(family: str = "meanfield"):
    return fedppl.PVIGuide(linear, family=family)


# name -> () -> (method, clients, run kwargs, num_rounds, tol or None); a tol stops the run
# before num_rounds (the early-stop line); None: the method has no tol
def _pvi():
    return fedppl.PVI(linear, _guide(), "synchronous", damping=0.5), _linear_clients(), {}, 6, 0.05


def _globalvi():
    return fedppl.GlobalVI(linear, _guide()), _linear_clients(), {}, 3, 1e-8


def _ep():
    method = fedppl.EP(linear, _guide("fullrank"), damping=0.5, tilted="exact")
    return method, _linear_clients(), {}, 6, 0.05


def _oneshot():
    return fedppl.OneShot(linear, _guide("fullrank")), _linear_clients(), {}, 1, None


def _dp_pvi():
    dp = fedppl.DPOptimisation(clip=1.0, noise_multiplier=2.0, sampling_rate=0.5)
    method = fedppl.PVI(linear, _guide(), "synchronous", damping=0.5, privacy=dp,
                        local_steps=5, num_particles=2)
    return method, _linear_clients(), {}, 3, 1e6  # a huge tol: stops after round 1


def _front(name: str, tol: float | None):
    def make():
        method, clients, kwargs, _ = FRONT[name]()
        return method, clients, kwargs, 3, tol

    return make


def _importance():
    pooled = fedppl.GlobalVI(linear, _guide()).run(jax.random.key(0), _linear_clients(),
                                                    progress_bar=False)
    method = fedppl.Importance(linear, _guide(), pooled.q, num_draws=200, ess_target=50.0)
    return method, _linear_clients(), {}, 3, None


METHODS = {"PVI": _pvi, "GlobalVI": _globalvi, "EP": _ep, "OneShot": _oneshot,
           "DP-PVI": _dp_pvi, "FederatedSGP": _front("FederatedSGP", 1e3),
           "FSGP": _front("FSGP", 1e3), "PFedMul": _front("PFedMul", 1e3),
           "FedBNR": _front("FedBNR", None), "CoTraining": _front("CoTraining", None),
           "Importance": _importance}
TOL = [n for n in METHODS if n not in ("OneShot", "FedBNR", "CoTraining", "Importance")]
# the text before the bar's ":" (the method's name and schedule)
DESC = {"OneShot": "one-shot", "PFedMul": "pFed-Mul", "DP-PVI": "PVI"}


def _run(method, clients, kwargs, num_rounds, tol, progress_bar):
    extra = {} if tol is None else {"tol": tol}
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the round log's warnings are not the bar
        result = method.run(jax.random.key(0), clients, num_rounds, progress_bar=progress_bar,
                            **kwargs, **extra)
    return result, err.getvalue()


@pytest.fixture(scope="module")
def runs():
    """name -> (method, clients, kwargs, num_rounds, tol, result, stderr), run once with the
    bar on and the method's tol."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            method, clients, kwargs, rounds, tol = METHODS[name]()
            result, err = _run(method, clients, kwargs, rounds, tol, True)
            cache[name] = (method, clients, kwargs, rounds, tol, result, err)
        return cache[name]

    return get


def _pairs(err: str) -> list[tuple[str, str]]:
    """The ``name=value`` pairs of the bar's last drawing."""
    drawn = [line for line in re.split(r"[\r\n]", err) if "=" in line and "|" in line]
    assert drawn, f"no progress bar with a quantity in {err!r}"
    return re.findall(r"(\w+)=([^,\]\s]+)", drawn[-1].rsplit("round", 1)[-1])


@pytest.mark.parametrize("name", list(METHODS))
def test_every_run_shows_a_bar_with_a_finite_quantity(runs, name):
    method, *_, result, err = runs(name)
    assert isinstance(result, Result)
    assert f"{DESC.get(name, name)}" in err
    pairs = _pairs(err)
    assert pairs and all(math.isfinite(float(v)) for _, v in pairs), pairs
    assert not re.search(r"=\s*(nan|inf)", err, re.IGNORECASE)
    # what it shows is the method's own quantity, not the stand-in count
    shown = {k for k, _ in pairs}
    assert shown & {spec.partition(":")[0] for spec in method.progress}, (shown,
                                                                         method.progress)


@pytest.mark.parametrize("name", list(METHODS))
def test_progress_bar_false_shows_none(runs, name):
    method, clients, kwargs, rounds, tol, *_ = runs(name)
    if name == "Importance":  # its run re-reads the model; a fresh object is as fast
        method = METHODS[name]()[0]
    result, err = _run(method, clients, kwargs, rounds, tol, False)
    assert isinstance(result, Result)
    assert err == "", err


@pytest.mark.parametrize("name", [*TOL, "Importance"])
def test_a_run_stopped_early_says_so_in_one_line(runs, name):
    _, _, _, rounds, tol, result, err = runs(name)
    assert result.num_rounds < rounds
    lines = [ln for ln in re.split(r"[\r\n]", err) if "stopped after round" in ln]
    assert len(lines) == 1, err
    want = f"stopped after round {result.num_rounds} of {rounds}: "
    assert want in lines[0] and lines[0].endswith(result.stopped)
    criterion = ("k-hat" if name == "Importance" else
                 "kl_change" if name in ("PVI", "GlobalVI", "EP", "DP-PVI") else
                 "relative change of")
    assert criterion in result.stopped and (tol is None or f"tol {tol:g}" in result.stopped)


def test_a_run_that_uses_every_round_leaves_no_line(runs):
    method, clients, kwargs, *_ = runs("PVI")
    result, err = _run(method, clients, kwargs, 2, 1e-300, True)
    assert result.num_rounds == 2 and result.stopped is None
    assert "stopped" not in err


@pytest.mark.parametrize("name", ["OneShot", "FedBNR", "CoTraining", "Importance"])
def test_methods_without_early_stopping_refuse_tol(runs, name):
    method, clients, kwargs, rounds, *_ = runs(name)
    with pytest.raises(TypeError, match="tol"):
        method.run(jax.random.key(0), clients, rounds, progress_bar=False, tol=1e-3, **kwargs)


@pytest.mark.parametrize("name", TOL)
@pytest.mark.parametrize("tol, error", [(0.0, ValueError), (-1.0, ValueError),
                                        (math.nan, ValueError), ("1e-3", TypeError)])
def test_tol_is_checked_before_anything_runs(runs, name, tol, error):
    method, clients, kwargs, rounds, *_ = runs(name)
    with pytest.raises(error, match="tol"):
        method.run(jax.random.key(0), clients, rounds, progress_bar=False, tol=tol, **kwargs)


def test_globalvi_tol_in_the_constructor_is_deprecated_and_still_works():
    with pytest.warns(DeprecationWarning, match="local_tol"):
        old = fedppl.GlobalVI(linear, _guide(), tol=1e-6)
    assert old.local_tol == 1e-6
    assert fedppl.GlobalVI(linear, _guide(), local_tol=1e-6).local_tol == 1e-6
    with pytest.raises(TypeError, match="local_tol"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fedppl.GlobalVI(linear, _guide(), tol=1e-6, local_tol=1e-6)


# -- the three settings that were accepted silently -----------------------------------------------


@pytest.mark.parametrize("make", [
    lambda s: fedppl.PVI(linear, _guide(), schedule=s),
    lambda s: fedppl.PVI(linear, _guide(), s),
    lambda s: fedppl.EP(linear, _guide(), schedule=s),
], ids=["PVI-keyword", "PVI-positional", "EP"])
def test_a_misspelt_schedule_is_refused_by_the_constructor(make):
    with pytest.raises(ValueError, match=r"schedule.*'synchronus'"):
        make("synchronus")


def test_clients_per_round_above_the_clients_is_refused_at_init():
    clients = _linear_clients(3)
    method = fedppl.PVI(linear, _guide(), "synchronous", clients_per_round=5)
    with pytest.raises(ValueError, match=r"clients_per_round=5 .*\(3\)"):
        method.init(jax.random.key(0), clients)
    with pytest.raises(ValueError, match="clients_per_round=4"):
        fedppl.EP(linear, _guide(), clients_per_round=4, tilted="exact").run(
            jax.random.key(0), clients, 1, progress_bar=False)
    # as many as there are is all of them
    fedppl.PVI(linear, _guide(), "synchronous", clients_per_round=3).init(jax.random.key(0),
                                                                          clients)


def _rising(r):
    return 0.5 + 0.3 * r  # 0.5, 0.8, 1.1: leaves (0, 1] at the server's counter 2


def test_an_ep_damping_schedule_leaving_the_unit_interval_is_refused_before_running():
    clients = _linear_clients(3)
    ep = fedppl.EP(linear, _guide("fullrank"), damping=_rising, tilted="exact")
    with pytest.raises(ValueError, match=r"damping .* 1\.1 at round 3 "):
        ep.run(jax.random.key(0), clients, 5, progress_bar=False)
    # sequential: a round is one server update per client, so counter 2 is in round 1
    seq = fedppl.EP(linear, _guide("fullrank"), "sequential", damping=_rising, tilted="exact")
    with pytest.raises(ValueError, match="at round 1 "):
        seq.run(jax.random.key(0), clients, 1, progress_bar=False)
    with pytest.raises(ValueError, match="nan at round 2 "):  # NaN is outside too
        fedppl.EP(linear, _guide("fullrank"), damping=lambda r: jnp.where(r == 1, jnp.nan, 0.5),
                  tilted="exact").run(jax.random.key(0), clients, 2, progress_bar=False)


def test_an_ep_damping_schedule_is_checked_each_round_before_it_is_applied():
    clients = _linear_clients(3)
    ep = fedppl.EP(linear, _guide("fullrank"), damping=_rising, tilted="exact")
    assert ep.run(jax.random.key(0), clients, 2, progress_bar=False).num_rounds == 2
    state = ep.init(jax.random.key(0), clients)
    for _ in range(2):
        state, _ = ep.update(state)
    q = state.server.q
    with pytest.raises(ValueError, match="at round 3 "):
        ep.update(state)
    assert state.round == 2 and state.server.q is q


# -- the pieces ---------------------------------------------------------------------------------


def test_postfix_never_shows_a_nan():
    info = {"messages_up": 3, "elbo": np.nan, "kl_change": 0.25,
            "site_change": np.array([np.nan, 2.0, 1.0]), "epsilon": np.array([np.nan] * 3)}
    assert postfix(info, ("elbo", "kl_change", "site_change:max", "epsilon:max")) == {
        "kl_change": "0.25", "site_change": "2"}
    assert postfix(info, ("site_change:mean",)) == {"site_change": "1.5"}
    assert postfix(info, ("elbo", "epsilon:max")) == {"messages_up": "3"}


def test_the_flower_server_runs_the_method_with_its_bar():
    """The Flower ServerApp's run shows the method's bar (and none when ``run_kwargs`` turns it
    off); the rounds here go through the embedded runtime in place of the nodes."""
    pytest.importorskip("flwr")
    from fedppl.runtime import flower
    from fedppl.runtime.embedded import make_round

    clients = _linear_clients(3)
    out = {}
    for bar in (True, False):
        method = fedppl.PVI(linear, _guide(), "synchronous")
        task = flower.Task(method, clients.client, 3, num_rounds=2,
                           run_kwargs={} if bar else {"progress_bar": False})
        server = flower._Server(None, task)
        server.names = list(clients.names)
        server._describe = lambda: clients
        server._runtime = lambda stand_in: make_round
        server._finish = lambda: None
        err = io.StringIO()
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert server.run().num_rounds == 2
        out[bar] = err.getvalue()
    assert "PVI (synchronous)" in out[True] and dict(_pairs(out[True]))["kl_change"]
    assert out[False] == ""
