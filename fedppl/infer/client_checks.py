"""The checks of the clients' data against a NumPyro model that every method with a Gaussian
``q`` over the model's global sites runs before anything is compiled (PVI, GlobalVI, EP, OneShot,
the check and the sampler): observations in their likelihood's support, indices in range, local
sites of one shape (:func:`check_clients`), and the hint for group effects left global
(:func:`hint_local_sites`). Each error names the client."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from fedppl import validation
from fedppl.algorithms import natural_gradient, solvers
from fedppl.clients import Clients
from fedppl.guides.pvi_guide import PVIGuide
from fedppl.model_call import READS_VALUES

__all__ = ["check_clients", "hint_local_sites"]


def check_clients(guide: PVIGuide, clients: Clients, model_kwargs: dict) -> None:
    """Before anything is compiled: every client's observations lie in their likelihood's
    support (Bernoulli labels in {0, 1}, counts non-negative integers...), and every client's
    model gives each local site the shape of the padded prototype."""
    clients.check()  # arrays may have changed in place since partitioning
    want = {} if guide.local_layout is None else {s.name: s.shape
                                                  for s in guide.local_layout.sites}
    pooled = clients.num_clients > 1 and _observations_in_support(
        guide.model, clients.pooled().client(0), model_kwargs)
    if not want and pooled:
        return  # one trace of the pooled rows; each client's is run to name a failing one
    for k in range(clients.num_clients):
        who, data = clients.names[k], clients.client(k)
        if pooled:  # the pooled rows' observations and indices were checked: shapes only
            got = _local_shapes(guide.model, data, model_kwargs, want, who)
        else:
            tr = _checked_trace(guide.model, data, model_kwargs, who)
            got = {name: tuple(jnp.shape(tr[name]["value"])) for name in want if name in tr}
        for name, shape in want.items():
            if name not in got:
                raise ValueError(f"{who}: the model has no local site '{name}' with this "
                                 "client's data")
            if got[name] != shape:
                raise ValueError(
                    f"local site '{name}' has shape {got[name]} for {who} but {shape} for "
                    f"{clients.names[0]}; every client's private guide must have one shape. "
                    "Give the model the number of groups as a static keyword argument (the "
                    "largest over clients; groups without data keep their prior)"
                )


def _trace(model: Callable, data: tuple, model_kwargs: dict) -> dict:
    from numpyro import handlers

    return handlers.trace(handlers.seed(model, 0)).get_trace(*data, **model_kwargs)


def _local_shapes(model: Callable, data: tuple, model_kwargs: dict, names: dict,
                  who: str) -> dict[str, tuple]:
    """The shapes of the local sites ``names`` on one client's data, from an abstract trace of
    the model (no program compiled: run op by op, each new data shape compiled each of the
    model's operations, a second or so per client); a model that reads its data's values
    while tracing runs op by op."""

    def values(*arrays):
        tr = _trace(model, arrays, model_kwargs)
        return {name: tr[name]["value"] for name in names if name in tr}

    try:
        try:
            out = jax.eval_shape(values, *data)
        except READS_VALUES:
            out = values(*data)
    except Exception as err:  # the model's own error, with the client's name
        raise ValueError(f"{who}: the model fails on this client's data: {err}") from err
    return {name: tuple(jnp.shape(v)) for name, v in out.items()}


def _checked_trace(model: Callable, data: tuple, model_kwargs: dict, who: str) -> dict:
    """The model's trace on ``data``, whose observations lie in their support and whose
    indices are in range: a ``ValueError`` naming ``who`` otherwise."""
    try:
        tr = _trace(model, data, model_kwargs)
    except Exception as err:  # the model's own error, with the client's name
        raise ValueError(f"{who}: the model fails on this client's data: {err}") from err
    validation.indices_in_range(model, data, model_kwargs, tr, who)
    for name, site in tr.items():
        if site["type"] != "sample" or not site["is_observed"]:
            continue
        inside = np.asarray(site["fn"].support(site["value"]))
        if not inside.all():
            bad = np.asarray(site["value"])[~inside] if inside.shape == np.shape(
                site["value"]) else np.asarray(site["value"]).ravel()[:5]
            raise ValueError(f"{who}: observed site '{name}' has values outside its "
                             f"distribution's support {site['fn'].support} (e.g. "
                             f"{np.unique(bad)[:5].tolist()})")
    return tr


def _observations_in_support(model: Callable, data: tuple, model_kwargs: dict) -> bool:
    """Whether the model runs on ``data`` with every observation in its likelihood's support
    and every index in range."""
    try:
        _checked_trace(model, data, model_kwargs, "pooled")
    except Exception:
        return False
    return True


def hint_local_sites(guide: PVIGuide, clients: Clients, model_kwargs: dict) -> None:
    """Warn about a global site in a plate (a vector of group effects) whose elements the
    clients' likelihoods touch in a pattern that says it is meant to be local: each element by
    one client only (making it local is the same model at far less cost), or each client the
    elements ``0 .. n_k - 1`` (groups numbered from 0 within each client: as a global site,
    different clients' groups share one element). Found from the model on the clients' data
    (the gradient of each client's log-likelihood), not from names."""
    from numpyro import handlers

    if clients.num_clients < 2 or getattr(guide, "log_lik_fn", None) is not None:
        return
    layout = guide.layout_or_raise()
    tr = handlers.trace(handlers.seed(guide.model, 0)).get_trace(*clients.client(0),
                                                                 **model_kwargs)
    plated = [s for s in layout.sites if s.size > 1 and tr[s.name]["cond_indep_stack"]
              and s.unconstrained_shape == s.shape]
    if not plated:
        return
    touched = np.asarray(_touched(solvers.bind(guide.model, model_kwargs), guide,
                                  clients.stacked, clients.mask))
    others = [n for n in layout.names if n not in {s.name for s in plated}]
    for s in plated:
        t = touched[:, s.slice]
        counts = t.sum(0)
        keep = ", ".join(repr(n) for n in others)
        if counts.max() == 1:
            validation.warn(
                f"the global site '{s.name}' has elements that each enter one client's "
                f"likelihood only: making it local (global_sites=[{keep}]) is the same model, "
                "with each client keeping its own elements and q over far fewer coordinates")
            continue
        n = t.sum(1)
        prefix = all(np.array_equal(t[k], np.arange(s.size) < n[k]) for k in range(len(t)))
        if prefix and len(set(n.tolist())) > 1:
            validation.warn(
                f"the global site '{s.name}' is shared unevenly: {s.name}[0] enters "
                f"{int(counts[0])} clients' likelihoods, {s.name}[{int(n.max()) - 1}] "
                f"{int(counts[int(n.max()) - 1])}, each client's the first n of them. That is "
                "the model as written (one element shared by the rows of every client that "
                "uses its index); if each client numbers its own groups from 0, different "
                "groups are merged into one: number them across clients, or make the site "
                f"local (global_sites=[{keep}])")


def _touched(model: Callable, guide: PVIGuide, data: tuple, masks: Array) -> Array:
    """``(K, D)``: the global coordinates each client's observed log-likelihood depends on."""
    layout = guide.layout_or_raise()

    def one(d, m):
        return natural_gradient.depends_on(natural_gradient.log_lik_fn(model, guide, d, m),
                                           layout.dim, layout.dtype)

    return jax.jit(jax.vmap(one))(data, masks)
