"""pFed-Mul rounds: CAVI monotonicity, messages, server guards, personalisation, bad clients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedppl.algorithms import pfedmul as pm
from fedppl.models import mogp

SPEC = mogp.MOGPSpec(("regression", "classification"), 2)


def _client(seed, n=(20, 20)):
    rng = np.random.default_rng(seed)
    Xs = [rng.uniform(0, 10, (k, 1)) if k else None for k in n]
    ys = [np.sin(Xs[0][:, 0]) + 0.2 * rng.normal(size=n[0]) if n[0] else None,
          (rng.uniform(size=n[1]) < 1 / (1 + np.exp(-2 * np.sin(Xs[1][:, 0])))).astype(float)
          if n[1] else None]
    return mogp.client_data(Xs, ys, SPEC, client=seed)


HYPER = mogp.init_hyper(SPEC, 1, phi0=[1.0, 0.5], phi1=[0.5, 2.0],
                        W=jnp.array([[0.8, 0.3], [0.6, -0.4]]), noise=0.1)


def test_cavi_elbo_never_decreases_with_mixed_tasks():
    data = _client(0)
    Z = mogp.sample_inducing(jax.random.PRNGKey(0), data, 12)
    _, _, trace = pm.local_cavi(SPEC, HYPER, Z, data, mogp.prior_qu(SPEC, HYPER, Z), 8, True)
    trace = np.asarray(trace)
    assert trace[-1] > trace[0] + 1.0
    assert np.all(np.diff(trace) >= -1e-10 * max(1.0, abs(trace[-1])))


@pytest.fixture(scope="module")
def federation():
    datas = [_client(0), _client(1, (20, 0)), _client(2, (0, 20))]  # one task only on 1 and 2
    cfg = pm.Config(spec=SPEC, variant="kernel", num_inducing=8, local_steps=1)
    server, clients = pm.init(cfg, HYPER, datas, jax.random.PRNGKey(0))
    return cfg, server, clients, datas


def test_round_messages_and_personalisation(federation):
    cfg, server, clients, datas = federation
    new, msgs = zip(*[pm.client_update(cfg, server.hyper, c, d, jax.random.PRNGKey(i))
                      for i, (c, d) in enumerate(zip(clients, datas))])
    for m, d in zip(msgs, datas):
        assert np.isfinite(float(m.elbo))
        assert float(m.num_obs) == float(d.mask.sum())
        assert np.all(np.asarray(m.grad.W) == 0) and np.all(np.asarray(m.noise_sum) == 0)
        assert np.any(np.asarray(m.grad.log_phi1) != 0)
        sizes = [np.size(x) for x in jax.tree_util.tree_leaves(m)]
        assert max(sizes) <= 4  # no data, no inducing inputs: only O(#hyperparameters) numbers
    # local groups (W, noise) become personal; the client with no regression keeps its noise
    assert not np.allclose(new[0].hyper.W, new[1].hyper.W)
    assert np.isclose(new[2].hyper.log_noise[0], HYPER.log_noise[0])
    assert not np.isclose(new[1].hyper.log_noise[0], HYPER.log_noise[0])
    # server: one Adam step on the kernel only
    s2, info = pm.server_update(cfg, server, list(msgs))
    assert info["rejected"] == [] and s2.round == 1
    assert np.allclose(s2.hyper.W, server.hyper.W)
    assert not np.allclose(s2.hyper.log_phi1, server.hyper.log_phi1)
    # ascent direction: averaged gradient and the step agree in sign
    avg = np.mean([np.asarray(m.grad.log_phi1) for m in msgs], 0)
    assert np.all(np.sign(np.asarray(s2.hyper.log_phi1 - server.hyper.log_phi1)) == np.sign(avg))


def test_server_rejects_non_finite_update(federation):
    cfg, server, clients, datas = federation
    _, msg = pm.client_update(cfg, server.hyper, clients[0], datas[0], jax.random.PRNGKey(0))
    bad = msg._replace(grad=msg.grad._replace(log_phi0=msg.grad.log_phi0.at[0].set(jnp.nan)))
    s2, info = pm.server_update(cfg, server, [bad], ids=["client-7"])
    assert info["rejected"] == ["client-7"] and s2 is server
    s3, info = pm.server_update(cfg, server, [bad, msg], ids=[7, 0])
    assert info["rejected"] == [7] and info["accepted"] == [0]
    assert np.all(np.isfinite(np.asarray(s3.hyper.log_phi0)))


def test_global_noise_is_pooled_closed_form():
    datas = [_client(3), _client(4)]
    cfg = pm.Config(spec=SPEC, variant="all", num_inducing=8, fraction=0.5)
    server, clients = pm.init(cfg, HYPER, datas, jax.random.PRNGKey(1))
    msgs = [pm.client_update(cfg, server.hyper, c, d, jax.random.PRNGKey(0))[1]
            for c, d in zip(clients, datas)]
    s2, _ = pm.server_update(cfg, server, msgs)
    pooled = (msgs[0].noise_sum + msgs[1].noise_sum) / (msgs[0].noise_count + msgs[1].noise_count)
    assert np.isclose(float(jnp.exp(s2.hyper.log_noise[0])), float(pooled[0]))
    assert float(s2.hyper.log_noise[1]) == float(HYPER.log_noise[1])  # no regression data
    assert pm.sample_clients(jax.random.PRNGKey(0), 10, 0.3) == sorted(
        pm.sample_clients(jax.random.PRNGKey(0), 10, 0.3)) and len(
        pm.sample_clients(jax.random.PRNGKey(0), 10, 0.3)) == 3
    _, new_clients, info = pm.run_round(cfg, server, clients, datas, jax.random.PRNGKey(2))
    assert len(info["accepted"]) == 1
    untouched = [i for i in range(2) if i not in info["accepted"]][0]
    assert new_clients[untouched] is clients[untouched]


def test_bad_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown variant"):
        pm.init(pm.Config(spec=SPEC, variant="everything"), HYPER, [_client(0)],
                jax.random.PRNGKey(0))
