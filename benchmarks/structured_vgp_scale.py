"""Seconds per optimisation step and compiled memory against M: SVIGP, the exact (alpha, Sigma)
family, RNVGP, Kronecker and TVGP.

Synthetic 3-D regression (``--points`` training points, minibatch ``--batch``); one step is one
jitted ``SVI.update`` with ``InducingELBO`` and Adam, hyperparameters learned. Per method and M:

* ``seconds``: median over ``--repeats`` steps after the compiled first one;
* ``memory_mib``: XLA's plan for the compiled step (``memory_analysis()``: arguments + outputs
  + temporaries), the memory a step needs beyond Python;
* for RNVGP, ``cg_iterations``: mean CG iterations per solve at the starting point (``T``).

Dense methods use M inducing inputs; the grid guides use ``m0`` points per dimension,
``M = m0^3`` up to 10^6. The last table gives the log-log slope of seconds against M over the
largest sizes of each method (O(M^3): 3; O(d T M^2): 2; Kronecker/Tucker, O(p m0^3) = O(M) in
3-D: 1) and RNVGP's time ratio at each doubling of M (4 for M^2, 8 for M^3). Run::

    python benchmarks/structured_vgp_scale.py            # CPU sizes (the committed results)
    python benchmarks/structured_vgp_scale.py --dense 500 1000 2000 4000 8000 --m0 10 100 215

Prints markdown tables and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _provenance import stamp

BENCHMARK = {
    "summary": ("seconds per optimisation step and compiled memory against M: SVIGP, the exact "
                "(alpha, Sigma) and the structured GPs"),
    "data": None,
    "quick": ["--svigp", "100", "--dense", "250", "--m0", "5", "--repeats", "1"],
    "full": [[]],
    "cost": "quick ~1 min; full ~5 min",
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--svigp", type=int, nargs="*", default=[100, 300, 1000, 2000, 4000])
    p.add_argument("--dense", type=int, nargs="*", default=[250, 500, 1000, 2000, 4000],
                   help="M for the exact (alpha, Sigma) family and RNVGP")
    p.add_argument("--m0", type=int, nargs="*", default=[5, 10, 22, 47, 100],
                   help="grid points per dimension (3-D) for kron and tvgp")
    p.add_argument("--q0", type=int, default=3)
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--points", type=int, default=5000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"
                                        / "structured_vgp_scale.json"))
    return p.parse_args()


def build(method: str, size: int, X: np.ndarray, args: argparse.Namespace):
    from fedppl.guides import kronecker, rnvgp
    from fedppl.guides import svgp as dense
    from fedppl.models import svgp

    if method in ("kron", "tvgp"):
        model = svgp.SparseGPRegression(svgp.Grid.over(X, size), batch_size=args.batch)
        guide = (kronecker.KroneckerGuide(model) if method == "kron"
                 else kronecker.TuckerGuide(model, rank=args.q0))
        return model, guide
    Z = np.random.default_rng(1).uniform(-2, 2, (size, X.shape[1]))
    model = svgp.SparseGPRegression(svgp.Points(Z, learn=method == "svigp"),
                                    batch_size=args.batch)
    if method == "svigp":
        return model, dense.SVIGPGuide(model)
    if method == "diag":
        return model, dense.DiagGuide(model)
    return model, rnvgp.RNVGPGuide(model, rnvgp.RandomisedConfig(probes=args.probes))


def cg_iterations(model, params: dict, X: np.ndarray, args: argparse.Namespace) -> float:
    """Mean unbiased-CG iterations of RNVGP's solves with ``A = K_uu + Sigma`` at ``params``."""
    from fedppl.guides.rnvgp import RandomisedConfig, probes, unbiased_cg
    from fedppl.models.kernels import SEParams
    from fedppl.models.sparse_gp import kzz

    h = SEParams(params["log_lengthscale"], params["log_variance"], params["log_noise"])
    A = kzz(jnp.asarray(model.inducing.Z), h) + jnp.diag(params["q_sigma"])
    cfg = RandomisedConfig(probes=args.probes)
    R = probes(jax.random.key(0), A.shape[0], cfg, A.dtype)
    its = jax.jit(jax.vmap(lambda r, k: unbiased_cg(A, r, k, cfg)[1], in_axes=(1, 0)))(
        R, jax.random.split(jax.random.key(1), R.shape[1]))
    return float(np.mean(its))


def measure(method: str, size: int, X: np.ndarray, y: np.ndarray, args: argparse.Namespace
            ) -> dict:
    from numpyro.infer import SVI

    from fedppl.models.svgp import InducingELBO

    model, guide = build(method, size, X, args)
    svi = SVI(model, guide, optax.adam(1e-3), InducingELBO())
    Xj, yj = jnp.asarray(X), jnp.asarray(y)
    state = svi.init(jax.random.key(0), Xj, yj)
    t0 = time.perf_counter()
    compiled = jax.jit(svi.update).lower(state, Xj, yj).compile()
    mem = compiled.memory_analysis()
    state, loss = compiled(state, Xj, yj)
    jax.block_until_ready(loss)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        state, loss = compiled(state, Xj, yj)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
    row = {"method": method, "M": int(model.num_inducing), "size": size,
           "seconds": float(np.median(times)), "compile_seconds": first - float(np.median(times)),
           "memory_mib": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                          + mem.temp_size_in_bytes) / 2**20,
           "temp_mib": mem.temp_size_in_bytes / 2**20, "loss_finite": bool(np.isfinite(loss))}
    if method == "rnvgp":
        row["cg_iterations"] = cg_iterations(model, svi.get_params(state), X, args)
    print(f"{method} M={row['M']:,}: {row['seconds']:.4f} s/step, {row['memory_mib']:.1f} MiB"
          + (f", T={row['cg_iterations']:.1f}" if "cg_iterations" in row else ""), flush=True)
    return row


def slope(rows: list[dict], last: int = 3) -> float:
    r = sorted(rows, key=lambda x: x["M"])[-last:]
    return float(np.polyfit(np.log([x["M"] for x in r]), np.log([x["seconds"] for x in r]), 1)[0])


def tables(rows: list[dict]) -> str:
    out = ["| method | M | s / step | MiB (args + out + temp) | temp MiB | CG iterations |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        its = f"{r['cg_iterations']:.1f}" if "cg_iterations" in r else ""
        out.append(f"| {r['method']} | {r['M']:,} | {r['seconds']:.4f} | {r['memory_mib']:.1f} "
                   f"| {r['temp_mib']:.1f} | {its} |")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out += ["", "| method | log-log slope of s/step against M (largest 3 sizes) |", "|---|---:|"]
    out += [f"| {m} | {slope([r for r in rows if r['method'] == m]):.2f} |" for m in methods
            if sum(r["method"] == m for r in rows) >= 2]
    pairs = {m: sorted((r for r in rows if r["method"] == m), key=lambda x: x["M"])
             for m in ("diag", "rnvgp")}
    if all(len(v) >= 2 for v in pairs.values()):
        out += ["", "| M | exact (alpha, Sigma): time ratio to M/2 | RNVGP: time ratio to M/2 |",
                "|---:|---:|---:|"]
        for a, b, c, d in zip(pairs["diag"], pairs["diag"][1:], pairs["rnvgp"],
                              pairs["rnvgp"][1:], strict=False):
            out.append(f"| {b['M']:,} | {b['seconds'] / a['seconds']:.2f} "
                       f"| {d['seconds'] / c['seconds']:.2f} |")
    return "\n".join(out)


def main() -> None:
    args = parse()
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (args.points, 3))
    y = np.sin(X[:, 0]) * np.cos(X[:, 1]) + 0.3 * X[:, 2] + 0.1 * rng.normal(size=args.points)
    t0 = time.perf_counter()
    rows = ([measure("svigp", m, X, y, args) for m in args.svigp]
            + [measure("diag", m, X, y, args) for m in args.dense]
            + [measure("rnvgp", m, X, y, args) for m in args.dense]
            + [measure(k, m0, X, y, args) for k in ("kron", "tvgp") for m0 in args.m0])
    text = tables(rows)
    print("\n" + text)
    payload = {"measured": "seconds per jitted SVI step (InducingELBO, Adam) and XLA's memory "
                           "plan for the step, against M; synthetic 3-D data",
               "settings": vars(args), "wall_seconds": time.perf_counter() - t0,
               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "devices": str(jax.devices()), "jax": jax.__version__,
                           "gpu": "none lent to this task: CPU only"},
               "rows": rows, "tables_markdown": text}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(stamp(payload), indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
