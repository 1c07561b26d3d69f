from __future__ import annotations

import gc
import os

# Small dense solves run ~30x slower with OpenBLAS threads fighting over 2 busy cores; one
# thread is what the test sizes want. Must be set before numpy loads OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

jax.config.update("jax_enable_x64", True)
# Long jobs on a busy 2-core machine deadlocked a few times under asynchronous CPU dispatch
# (jaxlib 0.10.2, every thread in a futex wait); the tests dispatch synchronously.
jax.config.update("jax_cpu_enable_async_dispatch", False)


# memory maps a test worker may hold before it drops its compiled code (the kernel's limit,
# vm.max_map_count, is 65,530 by default)
MAX_MAPS = 20_000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_code():
    """After a test module, if this worker holds more than ``MAX_MAPS`` memory maps, drop the
    compiled programs (the methods' shared rounds, ``fedppl.infer.base.clear_compiled``, and
    JAX's caches). Every compiled XLA:CPU program holds memory maps of its own: a worker that
    kept all of its share of the suite's programs reached 52,735 of the kernel's 65,530 and
    segfaulted in the compiler. Clearing after every module instead slowed the suite down
    (common programs compiled again in each module), hence the threshold."""
    yield
    if _memory_maps() > MAX_MAPS:
        from fedppl.infer.base import clear_compiled

        clear_compiled()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def one_ray_cluster():
    """The Flower Simulation Engine's runs in a test module share one Ray cluster (each run
    started and stopped its own: 5 to 10 s on this 2-core VM). Flower's Ray backend starts Ray
    only where it is not running already (as on a long-lived cluster); this keeps the cluster
    between runs, stopping only each run's workers, and stops it after the module. A run that
    asks for other start-up arguments (``num_workers``) gets a cluster started afresh with them.
    Use with ``pytestmark = pytest.mark.usefixtures("one_ray_cluster")``."""
    ray = pytest.importorskip("ray")
    backend = pytest.importorskip("flwr.server.superlink.fleet.vce.backend.raybackend")
    started: dict = {}
    real_init = backend.RayBackend.init_ray

    def init_ray(self, config):
        args = dict(config.get(self.init_args_key) or {})
        if ray.is_initialized() and started.get("args") != args:
            ray.shutdown()
        if not ray.is_initialized():
            started["args"] = args
            started["count"] = started.get("count", 0) + 1
        real_init(self, config)

    def terminate(self):  # the run's workers only; the cluster stays for the next run
        if self.pool:
            self.pool.terminate_all_actors()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend.RayBackend, "init_ray", init_ray)
        patch.setattr(backend.RayBackend, "terminate", terminate)
        yield started
    if ray.is_initialized():
        ray.shutdown()


def linear_model(X, y=None, noise=0.5):
    """Bayesian linear regression with known noise: the closed-form reference model."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, noise), obs=y)


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def random_intercepts(gid, y=None, *, n_groups):
    """``y_ij ~ N(mu + tau z_j, 1)``, ``z_j ~ N(0, 1)`` (non-centred random intercepts, a
    LogNormal group scale): the marginal over ``z`` is Gaussian, ``N(mu 1, I + tau^2 11')`` per
    group."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("groups", n_groups):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", gid.shape[0]):
        numpyro.sample("y", dist.Normal(mu + tau * z[gid], 1.0), obs=y)


def random_intercepts_logit(gid, y=None, *, n_groups):
    """The same random intercepts with a Bernoulli-logit likelihood (no closed form)."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.LogNormal(0.0, 1.0))
    with numpyro.plate("groups", n_groups):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", gid.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=mu + tau * z[gid]), obs=y)


def exact_linear_posterior(X, y, noise=0.5):
    prec = np.eye(X.shape[1]) + X.T @ X / noise**2
    cov = np.linalg.inv(prec)
    return cov @ X.T @ y / noise**2, cov


@pytest.fixture
def linear_data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.5 * rng.normal(size=120)
    return X, y


@pytest.fixture
def logistic_data():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(500, 3))
    logits = X @ np.array([1.5, -1.0, 0.5]) + 0.3
    y = (rng.uniform(size=500) < 1 / (1 + np.exp(-logits))).astype(float)
    return X, y


# The slowest test files, about slowest first (summed test times of a full run on this 2-core
# VM, measured with --junitxml), the Flower files spaced out so that two of them (each starting
# processes of its own) rarely run at once.
# make test runs pytest-xdist with --dist loadfile --no-loadscope-reorder: each worker takes the
# next file in collection order when it is free, so starting with the long files keeps one
# worker from running a long file alone at the end (longest-processing-time-first scheduling).
SLOW_FILES = (
    "tests/runtime/test_flower_deployment.py",
    "tests/test_readme.py",
    "tests/runtime/test_flower_secagg.py",
    "tests/infer/test_smc.py",
    "tests/test_local_sites.py",
    "tests/runtime/test_flower_simulation_faults.py",
    "tests/algorithms/test_one_shot.py",
    "tests/infer/test_variational.py",
    "tests/runtime/test_flower_simulation.py",
    "tests/test_model_shapes.py",
    "tests/algorithms/test_ep.py",
    "tests/runtime/test_flower_tls_example.py",
    "tests/infer/test_importance.py",
    "tests/test_audit.py",
    "tests/runtime/test_secure_pvi.py",
    "tests/runtime/test_secure_dp.py",
    "tests/runtime/test_flower_secure_pvi.py",
    "tests/test_dp_statistics.py",
    "tests/infer/test_front.py",
    "tests/test_tutorials.py",
    "tests/test_arviz.py",
    "tests/infer/test_sgp_edge_cases.py",
    "tests/infer/test_sparse_gps.py",
    "tests/test_hierarchical_users.py",
    "tests/algorithms/test_dp_pvi.py",
    "tests/pyro/test_check.py",
    "tests/pyro/test_ep.py",
    "tests/test_priors.py",
    "tests/float32/test_methods_float32.py",
    "tests/algorithms/test_sgp_pvi.py",
    "tests/pyro/test_front.py",
    "tests/algorithms/test_natural_gradient.py",
    "tests/infer/test_front_consistency.py",
    "tests/pyro/test_parity.py",
    "tests/float32/test_pvi_float32.py",
    "tests/float32/test_gp_uci_float32.py",
    "tests/runtime/test_faults.py",
    "tests/algorithms/test_fsgp.py",
    "tests/float32/test_importance_float32.py",
    "tests/test_cli.py",
    "tests/runtime/test_no_deadlock.py",
    "tests/algorithms/test_sgp_memory.py",
    "tests/infer/test_no_run_state_on_self.py",
    "tests/pyro/test_demo.py",
    "tests/models/test_mogp.py",
    "tests/experiments/test_fedbnr_uci.py",
    "tests/infer/test_retrace.py",
    "tests/algorithms/test_sgp_shared.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
