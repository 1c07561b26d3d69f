"""The Flower example as a user runs it: ``examples/flower/run_localhost.sh`` (README.md's
commands) on 127.0.0.1 with TLS, a SuperLink and two SuperNodes (each with fedppl's warm
ClientApp worker), two rounds: about 130 s on a busy 2-core machine (310 s when each message was
a fresh ClientApp process). The run must end as completed with the embedded runtime's answer,
leave no process behind, and the README must show the script's commands."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower tests need the flower extra: "
                    "pip install 'fedppl[flower]'")
from cryptography import x509

from fedppl.clients import Clients
from fedppl.runtime.embedded import Runtime, recording

EXAMPLE = Path(__file__).parents[2] / "examples" / "flower"
SCRIPT = EXAMPLE / "run_localhost.sh"
NODES, ROUNDS = 2, 2


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_ports(n: int) -> int:
    """A port p with p, ..., p + n - 1 all free on 127.0.0.1 now (SuperNode k serves on p + k)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        try:
            for k in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", first + k))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def _processes_mentioning(needles: list[str]) -> list[str]:
    """Command lines of this machine's processes that mention any of ``needles``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmd for n in needles):
            found.append(f"{proc.name}: {cmd}")
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The script's run: its output, its work folder, the ports and the time it took."""
    work = tmp_path_factory.mktemp("flower-tls")
    port, node_port = _free_ports(1), _free_ports(NODES)
    env = {**os.environ, "WORK": str(work), "PORT": str(port), "NODE_PORT": str(node_port),
           "NODES": str(NODES), "ROUNDS": str(ROUNDS), "RUN_TIMEOUT": "1200",
           "FLWR_TELEMETRY_ENABLED": "0",
           # flower-superlink, flower-supernode, flwr and python from this environment
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the script's trap stops what it started
        stdout, stderr = proc.communicate(timeout=60)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return {"out": out, "work": work, "seconds": time.monotonic() - t0,
            "needles": [str(work), f"127.0.0.1:{port}",
                        *(f"127.0.0.1:{node_port + k}" for k in range(NODES))]}


def test_script_completes_and_cleans_up(run):
    """The script exits 0 naming result.json, and every process it started (the SuperLink, the
    SuperNodes and their ServerApp and ClientApp processes) is gone within 20 s."""
    out = run["out"]
    assert out.returncode == 0, (f"run_localhost.sh exited {out.returncode}:\n"
                                 f"{(out.stdout + out.stderr)[-4000:]}")
    assert out.stdout.strip().splitlines()[-1] == str(run["work"] / "result" / "result.json")
    deadline = time.monotonic() + 20
    while (left := _processes_mentioning(run["needles"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"run_localhost.sh left processes running: {left}"
    print(f"run_localhost.sh took {run['seconds']:.0f} s")


def test_posterior_equals_the_embedded_runtime(run):
    """result.json records both rounds with every node's message received and nothing rejected,
    and the final server state (state.npz) equals the embedded runtime's on the same task to
    1e-9 relative, every value finite."""
    assert run["out"].returncode == 0, "the run failed (see test_script_completes_and_cleans_up)"
    folder = run["work"] / "result"
    result = json.loads((folder / "result.json").read_text())
    assert result["summary"]["rounds"] == ROUNDS, result["summary"]
    assert result["history"]["messages_up"] == [NODES] * ROUNDS, result["history"]
    assert result["rejected"] == [], result["rejected"]
    with np.load(folder / "state.npz") as f:
        got = [f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))]

    config = {"num-clients": NODES, "num-rounds": ROUNDS, "schedule": "synchronous", "seed": 0}
    task = _load("_flower_example_task",
                 EXAMPLE / "fedppl_flower_example" / "task.py").task(config)
    clients = Clients.from_list([task.load_partition(k) for k in range(NODES)])
    last = {}
    # planned as on the deployment, whose server holds no data (PVI's adaptive line search)
    task.method.run(jax.random.key(task.seed), clients, ROUNDS, progress_bar=False,
                    runtime=Runtime(recording(last), data_at_server=False))
    want = [np.asarray(x) for x in jax.tree_util.tree_leaves(last["server"])]
    assert len(got) == len(want), (len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.all(np.isfinite(a)), f"server state leaf {i} is not finite: {a}"
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12,
                                   err_msg=f"server state leaf {i}: Flower vs embedded")


def _commands(text: str) -> list[str]:
    """Shell commands in ``text`` (continuation lines joined, spaces collapsed) that start
    Flower, run make_certs.py or write flwr's config."""
    joined = re.sub(r"\\\n\s*", " ", text)
    starts = ("python make_certs.py", "flower-superlink", "flower-supernode",
              "python -m fedppl.runtime.flower_worker", "flwr ", "cat >", "export FLWR_HOME",
              "export JAX_")
    return [" ".join(line.split()) for line in joined.splitlines()
            if line.strip().startswith(starts)]


def test_readme_shows_the_scripts_commands():
    """Every command of run_localhost.sh that a user types (certificates, the SuperLink, the
    SuperNodes, flwr's config, the run, its status) appears verbatim in README.md."""
    script, readme = SCRIPT.read_text(), (EXAMPLE / "README.md").read_text()
    commands = _commands(script)
    assert len(commands) >= 6, commands
    shown = set(_commands(readme))
    missing = [c for c in commands if c not in shown]
    assert not missing, f"README.md does not show these commands of run_localhost.sh: {missing}"
    config = script.split("<<EOF\n")[1].split("\nEOF")[0]
    assert config in readme, f"README.md does not show flwr's config.toml as written:\n{config}"


def test_certificate_names_the_given_hosts(tmp_path):
    """make_certs.py: the server certificate is signed by the CA and names localhost, 127.0.0.1,
    ::1 and the host names and addresses given on the command line; the keys are owner-only."""
    make_certs = _load("_make_certs", EXAMPLE / "make_certs.py")
    assert make_certs.main(["--out", str(tmp_path), "superlink.example.org", "10.0.0.5"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((tmp_path / "server.pem").read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "superlink.example.org"]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == [
        "127.0.0.1", "::1", "10.0.0.5"]
    for key in ("ca.key", "server.key"):
        assert (tmp_path / key).stat().st_mode & 0o077 == 0, f"{key} is readable by others"
