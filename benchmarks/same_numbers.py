"""Same seeds, same numbers: each method family's numbers now against the numbers stored.

Each family of ``benchmarks/same_numbers_cases/`` (``pvi``, ``ep``, ``gallery``, ``sgp``,
``fedbnr``, ``pfedmul``, ``cotraining``) runs a few small problems at fixed seeds in float64
and returns what its methods end with (q or the final state, the history, test predictions).
This script runs each family in its own process with XLA's default flags and compares every
number with those stored in ``benchmarks/results/same_numbers_stored/<family>.json`` (written
by ``--record`` from a clean export of a named commit): the largest absolute difference per
case, and whether the case is bit-identical. A restructuring that should not change any number
must leave every case bit-identical on the machine that recorded them; another machine, BLAS
or XLA version may differ by round-off. Exits with status 1 when a case differs by more than
``--tolerance``.

    python benchmarks/same_numbers.py                        # every family (about 12 min)
    python benchmarks/same_numbers.py --families pvi pfedmul # some
    # store the numbers of a commit (a clean export, so no uncommitted edit is recorded)
    git archive HEAD | tar -x -C /tmp/stored && python benchmarks/same_numbers.py \\
        --record --code /tmp/stored --commit "$(git rev-parse HEAD)"

Writes the comparison to ``--out`` (default
``benchmarks/results/same_numbers_current_vs_stored.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _provenance import stamp

HERE = Path(__file__).resolve().parent
CASES = HERE / "same_numbers_cases"
STORED = HERE / "results" / "same_numbers_stored"
FAMILIES = ("pvi", "ep", "gallery", "sgp", "fedbnr", "pfedmul", "cotraining")

BENCHMARK = {
    "summary": "regression check: PVI, GlobalVI, EP, the gallery, the federated sparse GPs, "
               "FSGP, FedBNR, pFed-Mul and co-training on small fixed problems, every number "
               "against the numbers stored from a named commit (bit-identical where the "
               "programs are)",
    "data": None,
    "quick": ["--families", "pvi", "pfedmul"],
    "full": [[]],
    "cost": "quick ~3 min (pvi, pfedmul); full ~12 min",
}


def flatten(obj: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Every number of a nested result as float64 arrays keyed by their path."""
    if isinstance(obj, dict):
        out: dict[str, np.ndarray] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        try:
            return {prefix: np.asarray(obj, dtype=np.float64)}
        except (ValueError, TypeError):  # ragged: one entry per element
            out = {}
            for i, v in enumerate(obj):
                out.update(flatten(v, f"{prefix}/{i}"))
            return out
    return {prefix: np.asarray(obj, dtype=np.float64)}


def child(family: str, path: str) -> None:
    """Run one family (in this fresh process) and pickle its numbers, case by case."""
    import jax

    jax.config.update("jax_enable_x64", True)
    spec = importlib.util.spec_from_file_location(f"same_numbers_{family}",
                                                  CASES / f"{family}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import fedppl

    numbers = {case: flatten(value) for case, value in module.numbers().items()}
    with open(path, "wb") as f:
        pickle.dump({"numbers": numbers, "fedppl": str(Path(fedppl.__file__).parent)}, f)


def run_family(family: str, code: str | None) -> tuple[dict, str, float]:
    """``(numbers, where fedppl was imported from, seconds)`` of one family."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "numbers.pkl")
        start = time.perf_counter()
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", family,
                        "--dump", out], env=env, check=True, cwd=tmp)
        with open(out, "rb") as f:
            got = pickle.load(f)
    return got["numbers"], got["fedppl"], time.perf_counter() - start


def _encode(a: np.ndarray) -> dict:
    # JSON floats are written with repr, which round-trips every float64 exactly
    return {"shape": list(a.shape), "values": [float(x) for x in a.ravel()]}


def _decode(d: dict) -> np.ndarray:
    return np.asarray(d["values"], dtype=np.float64).reshape(d["shape"])


def compare_case(stored: dict[str, np.ndarray], now: dict[str, np.ndarray]) -> dict:
    """The largest absolute difference over a case's numbers, where, and bit-identity."""
    worst, where, identical = 0.0, "", True
    for key in sorted(set(stored) | set(now)):
        a, b = stored.get(key), now.get(key)
        if a is None or b is None or a.shape != b.shape:
            return {"max_abs": float("inf"), "worst": f"{key}: missing or reshaped",
                    "bit_identical": False, "numbers": len(now)}
        if np.array_equal(a, b, equal_nan=True):
            continue
        identical = False
        nan_moved = np.isnan(a) != np.isnan(b)
        both = ~(np.isnan(a) | np.isnan(b))
        diff = float("inf") if nan_moved.any() else float(np.max(np.abs(a[both] - b[both])))
        if diff >= worst:
            worst, where = diff, key
    return {"max_abs": worst, "worst": where or "-", "bit_identical": identical,
            "numbers": int(sum(v.size for v in now.values()))}


def _head(code: str) -> str | None:
    """The commit a checkout at ``code`` holds (None where it is no git checkout)."""
    out = subprocess.run(["git", "-C", code, "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--record", action="store_true",
                   help="store the numbers instead of comparing with them")
    p.add_argument("--code", default=None,
                   help="a checkout to import fedppl from (default: this one)")
    p.add_argument("--commit", default=None,
                   help="with --record and --code: the commit --code holds (default: its HEAD)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="largest absolute difference accepted (default 0: bit-identical)")
    p.add_argument("--out", default=str(HERE / "results" /
                                        "same_numbers_current_vs_stored.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.dump)
        return 0
    cases: dict[str, dict] = {}
    families: dict[str, dict] = {}
    source = ""
    for family in a.families:
        numbers, source, secs = run_family(family, a.code)
        print(f"{family}: {len(numbers)} cases in {secs:.0f} s (fedppl from {source})",
              flush=True)
        path = STORED / f"{family}.json"
        if a.record:
            commit = a.commit or (_head(a.code) if a.code else None)
            STORED.mkdir(parents=True, exist_ok=True)
            record = stamp({"family": family, "fedppl_from": source, "seconds": secs,
                            **({"commit": {"sha": commit}} if commit else {}),
                            "cases": {c: {k: _encode(v) for k, v in n.items()}
                                      for c, n in numbers.items()}})
            if commit is None and a.code:
                del record["commit"]  # this checkout's HEAD is not what ran
            path.write_text(json.dumps(record) + "\n")
            print(f"stored {path}")
            continue
        if not path.is_file():
            print(f"{family}: no stored numbers at {path} (run with --record first)")
            return 1
        stored = json.loads(path.read_text())
        families[family] = {k: stored.get(k) for k in ("commit", "date", "command")}
        families[family]["seconds"] = secs
        if stored.get("machine", {}).get("xla_flags") != os.environ.get("XLA_FLAGS"):
            print(f"{family}: XLA_FLAGS differ from the stored run's: round-off may differ")
        for case, n in numbers.items():
            ref = {k: _decode(v) for k, v in stored["cases"].get(case, {}).items()}
            cases[f"{family}: {case}"] = compare_case(ref, n)
    if a.record:
        return 0
    print("| case | largest absolute difference | where | bit-identical |\n|---|---:|---|---|")
    for case, r in cases.items():
        print(f"| {case} | {r['max_abs']:.2e} | {r['worst']} | {r['bit_identical']} |")
    bad = [c for c, r in cases.items() if not r["max_abs"] <= a.tolerance]
    verdict = (f"{len(cases) - len(bad)} of {len(cases)} cases within {a.tolerance:g} of the "
               "stored numbers" + (f"; differ: {', '.join(bad)}" if bad else ""))
    print(verdict)
    report = stamp({"what": "every number now against the stored numbers, same seeds, "
                            "float64, XLA's default flags",
                    "fedppl_from": source, "stored": families, "verdict": verdict,
                    "cases": cases})
    if a.code:  # what ran is the code at --code, not this checkout
        commit = a.commit or _head(a.code)
        report["commit"] = {"sha": commit} if commit else None
        if commit is None:
            del report["commit"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
