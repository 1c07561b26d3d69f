"""fedppl on Flower's Deployment Engine: a real SuperLink and three SuperNodes as processes on
127.0.0.1, each beside its warm ClientApp process (``fedppl.runtime.flower_worker``), the run
submitted with ``flwr run``, faults injected into the real thing: the answer equals the embedded
runtime's (for the clients that took part) and faults leave the server intact. One deployment
serves the module's runs (each a ``flwr run`` of its own app, secure aggregation's among them);
the faults test, which kills a node, runs last of those that use it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")

from fedppl.runtime import deployment as local
from fedppl.runtime.deployment import DeploymentError, LocalDeployment, write_app

from . import flower_tasks

APP = Path(__file__).parent / "flower_app"
# a round's timeout: a warm node answers within a second (its step compiled at set-up), so a
# node that has not answered in 8 s on a loaded 2-core machine is the injected straggler
TIMEOUT = 8.0

jax.config.update("jax_enable_x64", True)


def _run(fed, tmp_path, **config):
    out = tmp_path / "out"
    fed.run(APP, {**config, "result-dir": str(out)}, timeout=900)
    with np.load(out / "state.npz") as f:
        state = [f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))]
    return json.loads((out / "result.json").read_text()), state


@pytest.fixture(scope="module")
def fed():
    with LocalDeployment(3) as deployment:
        yield deployment


def test_warm_workers_serve_every_message(fed, tmp_path):
    """Every message of a run is handled by the nodes' warm ClientApp processes (none is
    started per message), the answer is the embedded runtime's, and the server compiles its
    update in the first round only. A second app (another FAB) on the same nodes makes each
    worker start afresh for it, and its answer is the same."""
    result, got = _run(fed, tmp_path, method="pvi-synchronous", rounds=3,
                       **{"line-search": False})
    _, want = flower_tasks.embedded("pvi-synchronous", rounds=3, line_search=False)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    assert result["rejected"] == []
    # each node's messages (set-up, rounds, finish) all handled by its own warm process
    for k in range(3):
        received = fed.log(f"node-{k}").count("Receiving: ")
        assert received >= 3 + 3 and fed.log(f"worker-{k}").count("message: ") == received
    compiles = result["history"]["server_compiles"]
    assert compiles[0] > 0 and not any(compiles[1:]), compiles
    other = write_app(tmp_path / "other", "tests.runtime.flower_tasks:task",
                      {"method": "pvi-synchronous", "rounds": 1, "line-search": False,
                       "result-dir": ""},
                      name="fedppl-other-app")
    out = tmp_path / "other-out"
    fed.run(other, {"result-dir": str(out)}, timeout=600)
    with np.load(out / "state.npz") as f:
        again = [f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))]
    _, want = flower_tasks.embedded("pvi-synchronous", rounds=1, line_search=False)
    for a, b in zip(again, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    assert all("restarting the worker" in fed.log(f"worker-{w}") for w in range(3))


def test_the_sampler_on_the_real_engine(fed, tmp_path):
    """The SMC sampler on the Deployment Engine: the particles stay at the server, each node
    keeps its own part of every particle and sends only its log-likelihoods; the server state
    after the rounds is the embedded runtime's."""
    result, got = _run(fed, tmp_path, method="smc", rounds=3)
    want_result, want = flower_tasks.embedded("smc", rounds=3)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    assert result["rejected"] == []
    assert result["history"]["beta"] == want_result.history["beta"].tolist()
    assert result["history"]["bytes_up"] == want_result.history["bytes_up"].tolist()


def test_secure_fsgp_on_the_real_engine(fed, tmp_path):
    """Secure aggregation inside FSGP's rounds (``Task.secure``: each exchange through SecAgg+,
    four messages a node; the task ``tests.runtime.flower_tasks:secure_task`` on the server and
    every node), one FedAvg round and the aggregation round: the parameters (securely summed)
    equal the plain embedded run's; the summed statistics equal the plain sum at them within the
    quantisation bound (the bounds are :mod:`tests.runtime.test_flower_secagg`'s)."""
    from fedppl.algorithms import exact, fsgp
    from fedppl.runtime.secagg import error_bound

    from .test_flower_secagg import SCALE, K, _fsgp_stats, _sums

    assert K == 3  # the module's deployment
    result, got = _run(fed, tmp_path, task="tests.runtime.flower_tasks:secure_task",
                       method="fsgp", rounds=1)
    assert result["rejected"] == []
    _, want = flower_tasks.embedded("fsgp", rounds=1)
    like = fsgp.init(fsgp.init_params(np.zeros((5, 1))))  # the server state's structure
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), got)
    params = jax.tree_util.tree_leaves(state.params)
    for a, b in zip(params, want[:len(params)], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    _sums(_fsgp_stats(state.params), exact.Stats(*state.stats), error_bound(SCALE, K))


def test_secure_pvi_on_the_real_engine(fed, tmp_path):
    """Synchronous PVI with SecAgg+ inside its rounds (the task
    ``tests.runtime.flower_tasks:secure_task``, ``line-search`` off), two rounds: q (the server
    state's first two leaves, its natural parameters) equals the plain embedded run's within the
    secure sums' quantisation bound, not bit for bit (the Simulation Engine's test and the
    bounds: ``test_flower_secure_pvi.py``)."""
    from fedppl.runtime.secure import sum_error

    rounds = 2
    result, got = _run(fed, tmp_path, task="tests.runtime.flower_tasks:secure_task",
                       method="pvi-synchronous", rounds=rounds, **{"line-search": False})
    assert result["rejected"] == []
    _, want = flower_tasks.embedded("pvi-synchronous", rounds=rounds, line_search=False)
    bound = rounds * sum_error(flower_tasks.SECURE_SCALE, 3)
    gaps = [float(np.max(np.abs(a - b))) for a, b in zip(got[:2], want[:2], strict=True)]
    assert max(gaps) <= bound and max(gaps) > 0, gaps
    # the local free energy stayed at the clients (NaN, which the result's JSON writes as null)
    assert all(v is None for row in result["history"]["free_energy"] for v in row)


def test_faults_on_the_real_engine(fed, tmp_path):
    """PVI on the Deployment Engine with a straggler slower than the round's timeout and a node
    that sends NaN (round 2), the same node sending a message with which q is not positive
    definite (round 3), and a SuperNode killed during the run: the run completes, ``rejected``
    names each event, no server state is non-finite, and the posterior equals an embedded run
    with the same participating clients (so the straggler's late answer was never applied).
    (PVI's line search is off here: it scores candidates on every
    client's data, which a dead node cannot give, so its steps would differ from the embedded
    run's, where every client's data are at hand.)"""
    done = {}

    def run():
        try:
            done["out"] = _run(fed, tmp_path, method="pvi-synchronous", rounds=3,
                               faults="1:2:slow 2:2:nan 2:3:improper",
                               **{"round-timeout": TIMEOUT, "line-search": False})
        except BaseException as err:  # reported below
            done["error"] = err

    before = fed.log("node-0").count("Receiving: train")  # earlier runs' messages
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 600
    while (fed.log("node-0").count("Receiving: train") < before + 2
           and time.monotonic() < deadline):
        time.sleep(0.2)
    fed.kill_node(0)  # as its round-2 step starts
    thread.join(900)
    assert "error" not in done, done.get("error")
    result, got = done["out"]
    why = {(r, who): reason for r, who, reason in result["rejected"]
           if not reason.startswith("final acknowledgement")}
    # the injected faults (on a loaded machine a slow answer may show as a timeout instead)
    for key, cause in (((2, "client 1"), f"no answer within {TIMEOUT:g}"),
                       ((2, "client 2"), "not finite"), ((3, "client 2"), "positive definite")):
        assert key in why and (cause in why[key] or "no answer" in why[key]), why
    assert "no answer" in why[(3, "client 0")]  # gone from round 2 or 3 on
    absent: dict[int, list[int]] = {}
    for r, who in why:
        absent.setdefault(r, []).append(int(who.split()[-1]))
    _, want = flower_tasks.embedded("pvi-synchronous", rounds=3, absent=absent,
                                    line_search=False)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10, err_msg=str(result["rejected"]))
    assert np.all(np.isfinite(np.concatenate([np.ravel(a) for a in got])))


def test_unreachable_superlink_is_a_clear_error(tmp_path):
    """A SuperLink that does not start (its port is taken): an error naming what it waited for,
    within the start timeout, and no process left behind."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        deployment = LocalDeployment(1, start_timeout=30, port=taken)
        t0 = time.monotonic()
        with pytest.raises(DeploymentError, match="SuperLink"), deployment:
            pass
        assert time.monotonic() - t0 < 60
    assert all(p.poll() is not None for p in deployment.procs.values())


def test_ports_are_chosen_below_the_ephemeral_range():
    """Outgoing connections take their local ports from the kernel's ephemeral range, so a
    port chosen there can be gone before its server binds it: the chosen ports lie below it,
    none of those to avoid, each free."""
    import socket

    low = local._ephemeral_low()
    chosen = [local.free_port() for _ in range(20)]
    assert all(10_000 <= p < low for p in chosen)
    again = local.free_port(avoid=chosen)
    assert again not in chosen
    with socket.socket() as s:
        s.bind(("127.0.0.1", again))  # free


@pytest.mark.parametrize("fork", [True, False])
def test_a_port_taken_before_its_node_binds_it_is_retried(monkeypatch, fork):
    """The failure seen at K = 50 (``SuperNode Runtime HTTP API failed to start``: its port
    taken between its choice and its bind), injected: the node's first port is held by a
    listener; the node starts again on another, the deployment comes up and says so; whether
    the nodes are forks of one process that imported Flower or processes of their own."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken, choose, calls = held.getsockname()[1], local.free_port, []

        def first_node_port_taken(avoid=()):
            calls.append(avoid)
            return taken if len(calls) == 2 else choose(avoid)  # call 1: the SuperLink's

        monkeypatch.setattr(local, "free_port", first_node_port_taken)
        with LocalDeployment(1, isolation="subprocess", node_poll=None, fork=fork) as fed:
            assert ("fork-server" in fed.procs) == fork
            assert fed.restarts == [("node-0", taken)]
            assert fed.ports["node-0"] != taken
            assert "Activated node_id" in fed.log("superlink")
    assert all(p.poll() is not None for p in fed.procs.values())


def test_ten_nodes_start_and_stop_five_times_in_a_row():
    """Five starts and stops of a K = 10 deployment in a row (one warm worker shared by the
    nodes, to keep the test short): every start brings all ten SuperNodes up, registered with
    the SuperLink on ports of their own, and every stop ends every process and frees every
    port (what a start that failed one time in three, before, did not). The nodes are forks of
    one process that imported Flower (each its own process group), so a start costs one import
    of Flower, not ten."""
    import socket

    for attempt in range(5):
        with LocalDeployment(10, workers=1, start_timeout=120) as fed:
            assert fed.log("superlink").count("Activated node_id") >= 10, attempt
            assert len(set(fed.ports.values())) == 11, fed.ports  # the SuperLink's and 10 nodes'
            ports = dict(fed.ports)
            if attempt == 0 and Path("/proc").is_dir():  # each node: a child of the fork server
                server = fed.procs["fork-server"].pid
                for k in range(10):
                    pid = fed.procs[f"node-{k}"].pid
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    assert (int(stat[1]), int(stat[2])) == (server, pid), (k, stat[:3])
        assert all(p.poll() is not None for p in fed.procs.values()), attempt
        for name, port in ports.items():
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))  # nothing listens there any more
                assert s.getsockname()[1] == port, name


def test_a_refused_token_ends_the_request_not_the_worker():
    """A SuperNode that refuses a task's token (HTTP 401: the task ended while its heartbeat
    was on its way) makes Flower's retries interrupt the whole process; a warm worker serves
    every task of its nodes, so for it the request fails and the process goes on."""
    import httpx

    from fedppl.runtime import flower_worker

    request = httpx.Request("POST", "http://127.0.0.1:1/v1/runtime/send-task-heartbeat")
    refused = httpx.HTTPStatusError("401", request=request,
                                    response=httpx.Response(401, request=request))
    calls = []

    def beat():
        calls.append(1)
        raise refused

    with pytest.raises(httpx.HTTPStatusError):
        flower_worker._retry_invoker().invoke(beat)
    assert calls == [1]  # given up at once, and this process was not interrupted
