"""The Pyro messengers against the NumPyro handlers, on each model written twice.

Each fedppl messenger (``cavity``, ``client``, ``tempered``, ``polya_gamma``) is applied to the
Pyro model and the matching fedppl handler to the NumPyro model; the joint log density at the same
values must agree to 1e-10, alone and composed with each PPL's own ``scale``, ``mask``,
``condition``, ``block`` and ``replay`` in both nestings (``trace`` records every one of them).
The NumPyro handlers are themselves tested against closed forms in ``tests/handlers/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as nd
import pyro
import pyro.distributions as pd
import pytest
import torch
from numpyro import handlers as nh
from numpyro.infer.util import log_density
from pyro import poutine

import fedppl.handlers as jh
import fedppl.pyro.handlers as th
from fedppl.families import gaussian as jg
from fedppl.pyro.families import gaussian as tg
from fedppl.pyro.sites import SiteLayout as TorchLayout
from fedppl.sites import SiteLayout as JaxLayout
from tests.pyro import models

RNG = np.random.default_rng(0)
A = RNG.normal(size=(4, 4))
CAV_MEAN, CAV_COV = np.array([0.5, -0.3, 0.2, -0.4]), 0.3 * (A @ A.T + np.eye(4))
X6 = RNG.normal(size=(6, 2))
REAL = np.arange(6) < 4  # the last two rows are padding
Y6 = np.where(REAL, X6 @ np.array([1.0, -0.5]) + 0.3 * RNG.normal(size=6), 50.0)
Y_BIN = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
OMEGA = RNG.uniform(0.05, 0.25, 6)


def torch_values(values: dict) -> dict:
    return {k: torch.as_tensor(np.asarray(v)) for k, v in values.items()}


def numpyro_log_density(model, args, values) -> float:
    return float(log_density(model, args, {}, values)[0])


def pyro_log_density(model, args, values) -> float:
    args = tuple(torch.as_tensor(a) if isinstance(a, np.ndarray) else a for a in args)
    tr = poutine.trace(th.substitute(model, torch_values(values))).get_trace(*args)
    return float(tr.log_prob_sum())


# -- cavity: the joint log density, mean-field and full rank, with a constrained site ------------


@pytest.fixture(scope="module")
def scale_case():
    pair = models.scale()
    X, y = pair.arrays
    jl = JaxLayout.from_model(pair.numpyro, X, y)
    tl = TorchLayout.from_model(pair.pyro, torch.as_tensor(X), torch.as_tensor(y))
    theta = np.array([0.4, -0.2, 0.1, -0.7])  # s = exp(-0.7): its unconstrained coordinate
    values = {k: np.asarray(v) for k, v in jl.constrain(jnp.asarray(theta)).items()}
    return pair, jl, tl, values


def cavities(family):
    if family == "fullrank":
        return (jg.FullGaussian.from_moments(jnp.asarray(CAV_MEAN), jnp.asarray(CAV_COV)),
                tg.FullGaussian.from_moments(torch.as_tensor(CAV_MEAN), torch.as_tensor(CAV_COV)))
    var = np.diag(CAV_COV)
    return (jg.DiagGaussian.from_moments(jnp.asarray(CAV_MEAN), jnp.asarray(var)),
            tg.DiagGaussian.from_moments(torch.as_tensor(CAV_MEAN), torch.as_tensor(var)))


@pytest.mark.parametrize("family", ["meanfield", "fullrank"])
def test_cavity_joint_log_density_equals_numpyros(scale_case, family):
    pair, jl, tl, values = scale_case
    jq, tq = cavities(family)
    assert tl.names == jl.names and tl.dim == jl.dim == 4
    theta = np.asarray(jl.unconstrain(values))
    np.testing.assert_allclose(tl.unconstrain(torch_values(values)).numpy(), theta, rtol=1e-14)
    ref = numpyro_log_density(jh.cavity(pair.numpyro, jq, jl), pair.arrays, values)
    got = pyro_log_density(th.cavity(pair.pyro, tq, tl), pair.arrays, values)
    assert got == pytest.approx(ref, abs=1e-10, rel=1e-12)
    # and it is the likelihood plus the cavity's density at theta, with the Jacobian of s
    X, y = pair.arrays
    lik = float(pd.Normal(torch.as_tensor(X @ values["w"] + values["b"]),
                          float(values["s"])).log_prob(torch.as_tensor(y)).sum())
    by_hand = lik + float(tg.log_prob(tq, torch.as_tensor(theta))) - theta[3]
    assert got == pytest.approx(by_hand, abs=1e-10)


class Wrap(NamedTuple):
    numpyro: Callable  # model -> model, with numpyro's handler
    pyro: Callable  # model -> model, with Pyro's messenger


def _replay(model, values, ppl):
    """Replay against a trace of the model at ``values`` (the guide trace of an ELBO)."""
    if ppl == "numpyro":
        tr = nh.trace(nh.substitute(nh.seed(model, 0), values)).get_trace(*models.scale().arrays)
        return nh.replay(model, tr)
    X, y = (torch.as_tensor(a) for a in models.scale().arrays)
    tr = poutine.trace(th.substitute(model, torch_values(values))).get_trace(X, y)
    return poutine.replay(model, trace=tr)


COND = {"b": 0.3}
WRAPS = {
    "scale": Wrap(lambda m, v: nh.scale(m, 0.5), lambda m, v: poutine.scale(m, 0.5)),
    "mask": Wrap(lambda m, v: nh.mask(m, mask=False), lambda m, v: poutine.mask(m, False)),
    "condition": Wrap(lambda m, v: nh.condition(m, COND),
                      lambda m, v: poutine.condition(m, torch_values(COND))),
    # b keeps a value (substituted inside block), hidden from the handler when it is outside
    "block": Wrap(lambda m, v: nh.block(nh.substitute(m, {"b": v["b"]}), hide=["b"]),
                  lambda m, v: poutine.block(th.substitute(m, torch_values({"b": v["b"]})),
                                             hide=["b"])),
    "replay": Wrap(lambda m, v: _replay(m, v, "numpyro"), lambda m, v: _replay(m, v, "pyro")),
}


@pytest.mark.parametrize("outside", [False, True], ids=["handler-inside", "handler-outside"])
@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_cavity_composes_like_numpyros(scale_case, wrap, outside):
    pair, jl, tl, values = scale_case
    jq, tq = cavities("fullrank")
    w = WRAPS[wrap]
    given = {k: v for k, v in values.items() if not (wrap == "condition" and k in COND)}
    if outside:  # the fedppl handler around PPL's handler around the model
        jm = jh.cavity(w.numpyro(pair.numpyro, values), jq, jl)
        tm = th.cavity(w.pyro(pair.pyro, values), tq, tl)
    else:
        jm = w.numpyro(jh.cavity(pair.numpyro, jq, jl), values)
        tm = w.pyro(th.cavity(pair.pyro, tq, tl), values)
    ref = numpyro_log_density(jm, pair.arrays, given)
    got = pyro_log_density(tm, pair.arrays, given)
    assert got == pytest.approx(ref, abs=1e-10, rel=1e-12), (wrap, outside)
    if wrap == "mask":
        assert got == 0.0


def test_cavity_checks_its_arguments(scale_case):
    _, _, tl, _ = scale_case
    with pytest.raises(ValueError, match="dimension 2"):
        th.cavity(models.scale_py, tg.DiagGaussian(torch.zeros(2), torch.ones(2)), tl)
    with pytest.raises(ValueError, match="both"):
        th.cavity(models.scale_py, None, tl)


# -- client, tempered, polya_gamma ----------------------------------------------------------------


def reg_np(X, y=None):
    w = numpyro.sample("w", nd.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Normal(X @ w, 1.0), obs=y)


def reg_py(X, y=None):
    w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Normal(X @ w, 1.0), obs=y)


def bin_np(X, y=None):
    w = numpyro.sample("w", nd.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", nd.Bernoulli(logits=X @ w), obs=y)


def bin_py(X, y=None):
    w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", X.shape[0]):
        pyro.sample("y", pd.Bernoulli(logits=X @ w), obs=y)


W = {"w": np.array([0.7, -0.4])}
MASK = REAL

# name -> (numpyro model, pyro model, y, numpyro handler, pyro messenger)
HANDLERS = {
    "client": (reg_np, reg_py, Y6, lambda m: jh.client(m, mask=jnp.asarray(MASK), num_data=8),
               lambda m: th.client(m, mask=torch.as_tensor(MASK), num_data=8)),
    "tempered": (reg_np, reg_py, Y6, lambda m: jh.tempered(m, alpha=0.3, sites=["w"]),
                 lambda m: th.tempered(m, alpha=0.3, sites=["w"])),
    "polya_gamma": (bin_np, bin_py, Y_BIN,
                    lambda m: jh.polya_gamma(jh.client(m, mask=jnp.asarray(MASK)),
                                             omega=jnp.asarray(OMEGA)),
                    lambda m: th.polya_gamma(th.client(m, mask=torch.as_tensor(MASK)),
                                             omega=torch.as_tensor(OMEGA))),
}

def _guide_trace(ppl):
    """A guide's trace with ``w`` at ``W`` (what an ELBO replays the model against)."""
    if ppl == "numpyro":
        def guide_np():
            numpyro.sample("w", nd.Normal(0.0, 1.0).expand([2]).to_event(1))

        return nh.trace(nh.substitute(guide_np, W)).get_trace()

    def guide_py():
        pyro.sample("w", pd.Normal(0.0, 1.0).expand([2]).to_event(1))

    return poutine.trace(th.substitute(guide_py, torch_values(W))).get_trace()


# PPL handlers around (or inside) them (replay: against a trace at W, as an ELBO replays the
# model against its guide's trace); condition observes y (the data) instead of obs=
OTHER = {
    "none": Wrap(lambda m: m, lambda m: m),
    "scale": Wrap(lambda m: nh.scale(m, 0.5), lambda m: poutine.scale(m, 0.5)),
    "mask": Wrap(lambda m: nh.mask(m, mask=jnp.asarray([True, False] * 3)),
                 lambda m: poutine.mask(m, torch.as_tensor([True, False] * 3))),
    "block": Wrap(lambda m: nh.block(nh.substitute(m, W), hide=["w"]),
                  lambda m: poutine.block(th.substitute(m, torch_values(W)), hide=["w"])),
    "replay": Wrap(lambda m: nh.replay(m, _guide_trace("numpyro")),
                   lambda m: poutine.replay(m, trace=_guide_trace("pyro"))),
}


@pytest.mark.parametrize("outside", [False, True], ids=["handler-inside", "handler-outside"])
@pytest.mark.parametrize("other", sorted(OTHER))
@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_messengers_compose_like_numpyros_handlers(name, other, outside):
    jm0, tm0, y, jwrap, twrap = HANDLERS[name]
    w = OTHER[other]
    jm = jwrap(w.numpyro(jm0)) if outside else w.numpyro(jwrap(jm0))
    tm = twrap(w.pyro(tm0)) if outside else w.pyro(twrap(tm0))
    ref = numpyro_log_density(jm, (X6, y), W)
    got = pyro_log_density(tm, (X6, y), W)
    assert got == pytest.approx(ref, abs=1e-10, rel=1e-12), (name, other, outside)


@pytest.mark.parametrize("outside", [False, True], ids=["condition-inside", "condition-outside"])
@pytest.mark.parametrize("name", sorted(HANDLERS))
def test_an_observation_made_by_condition_counts_in_either_nesting(name, outside):
    """``y`` observed through ``condition`` (not ``obs=``), the messenger inside or outside it."""
    jm0, tm0, y, jwrap, twrap = HANDLERS[name]
    if outside:
        jm = jwrap(nh.condition(jm0, {"y": jnp.asarray(y)}))
        tm = twrap(poutine.condition(tm0, {"y": torch.as_tensor(y)}))
    else:
        jm = nh.condition(jwrap(jm0), {"y": jnp.asarray(y)})
        tm = poutine.condition(twrap(tm0), {"y": torch.as_tensor(y)})
    ref = numpyro_log_density(jm, (X6,), W)
    got = pyro_log_density(tm, (X6,), W)
    assert got == pytest.approx(ref, abs=1e-10, rel=1e-12)
    direct = pyro_log_density(twrap(tm0), (X6, y), W)  # the same as obs=
    assert got == pytest.approx(direct, abs=1e-12)


def test_client_minibatch_by_draw_and_errors():
    def sub_py(X, y=None):
        w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", X.shape[0], subsample_size=2) as idx:
            pyro.sample("y", pd.Normal(X[idx] @ w, 1.0), obs=y[idx])

    X, y = torch.as_tensor(X6), torch.as_tensor(Y6)
    mask = torch.as_tensor(MASK)
    seen = []
    for draw in range(3):
        tr = poutine.trace(th.substitute(th.client(sub_py, mask=mask, draw=draw),
                                         torch_values(W))).get_trace(X, y)
        seen += tr.nodes["data"]["value"].tolist()
        kept = tr.nodes["y"]["mask"]
        assert kept.tolist() == mask[tr.nodes["data"]["value"]].tolist()
    assert sorted(seen) == list(range(6))  # three draws of two rows cover the six rows

    def outside(X, y=None):
        w = pyro.sample("w", pd.Normal(0.0, 1.0).expand([2]).to_event(1))
        pyro.sample("y", pd.Normal(X @ w, 1.0).to_event(1), obs=y)

    with pytest.raises(ValueError, match="not inside a plate of size 6"):
        poutine.trace(th.client(outside, mask=mask)).get_trace(X, y)
    with pytest.raises(ValueError, match="one-dimensional"):
        th.client(reg_py, mask=torch.ones(2, 3, dtype=torch.bool))


def test_polya_gamma_records_the_logits_and_names_bad_labels():
    X = torch.as_tensor(X6)
    tr = poutine.trace(th.substitute(th.polya_gamma(bin_py), torch_values(W))).get_trace(
        X, torch.as_tensor(Y_BIN))
    f = tr.nodes["y"]["infer"]["polya_gamma"]["logits"]
    np.testing.assert_allclose(f.numpy(), X6 @ W["w"], rtol=1e-14)
    for bad, words in ((Y_BIN * 2, "labels [2.0]"), (-Y_BIN, "labels [-1.0]")):
        with pytest.raises(ValueError, match=r"site 'y' has " + words.replace("[", r"\[")):
            poutine.trace(th.polya_gamma(bin_py)).get_trace(X, torch.as_tensor(bad))
    with pytest.raises(ValueError, match="not an observed Bernoulli"):
        poutine.trace(th.polya_gamma(reg_py, sites=["y"])).get_trace(X, torch.as_tensor(Y6))


def test_tempered_scales_latent_sites_only():
    tr = poutine.trace(th.tempered(reg_py, alpha=0.1, sites=["w", "y"])).get_trace(
        torch.as_tensor(X6), torch.as_tensor(Y6))
    assert tr.nodes["w"]["scale"] == 0.1 and tr.nodes["y"]["scale"] == 1.0
    with pytest.raises(ValueError, match="non-negative"):
        th.tempered(reg_py, alpha=-1.0, sites=["w"])
