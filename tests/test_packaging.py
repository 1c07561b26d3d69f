"""Packaging metadata: declared dependencies are true, installed, pinned and complete.

* every requirement of ``project.dependencies`` and of the extras ``make test`` installs is met by
  the installed version, and has a lower bound;
* constraints.txt pins every such direct dependency to exactly its declared lower bound, so the
  CI install (``pip install -c constraints.txt``) is the minimum tested set;
* every top-level third-party import in ``fedppl/`` and ``fedppl_experiments/`` belongs to a
  declared runtime dependency (``project.dependencies`` or a non-dev extra), and every declared
  runtime dependency is imported somewhere;
* ``fedppl/py.typed`` ships (source tree, installed package and a freshly built wheel), the
  license is the SPDX string and the project URLs are set.
"""

from __future__ import annotations

import ast
import email
import functools
import importlib.metadata as md
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DIST = "fedppl"
FIRST_PARTY_PACKAGES = ("fedppl", "fedppl_experiments")
LICENSE = "Apache-2.0"
URL_LABELS = ("Homepage", "Repository", "Documentation", "Issues")
# extras of tools, not of the library: the test tools, and the documentation build
TOOL_EXTRAS = ("dev", "docs")


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _tested_extras() -> list[str]:
    """The extras the Makefile installs (with ``-c constraints.txt``): what the tests run under."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(r'pip install[^\n]*-c constraints\.txt[^\n]*-e "\.\[([^\]]*)\]"', text)
    assert m, "Makefile no longer installs fedppl with -c constraints.txt -e \".[extras]\""
    return sorted(e.strip() for e in m.group(1).split(",") if e.strip())


def _requirements(extras: list[str] | None = None) -> list[Requirement]:
    """``project.dependencies`` plus the given extras (default: those ``make test`` installs)."""
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    optional = project.get("optional-dependencies", {})
    for extra in _tested_extras() if extras is None else extras:
        assert extra in optional, f"extra {extra!r} is installed by the Makefile but not declared"
        reqs += [Requirement(r) for r in optional[extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def _runtime_distributions() -> set[str]:
    """Distributions library code may import: core dependencies and every extra but the tools'."""
    project = _pyproject()["project"]
    names = [Requirement(r).name for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra not in TOOL_EXTRAS:
            names += [Requirement(r).name for r in reqs]
    return {canonicalize_name(n) for n in names}


def _lower_bound(req: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=", "===")]
    return max(bounds) if bounds else None


def _constraints() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for raw in (ROOT / "constraints.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"not an exact pin: {raw!r}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{req.name} pinned twice in constraints.txt"
        pins[name] = Version(specs[0].version)
    return pins


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> files importing it (absolute imports, anywhere in the file)."""
    found: dict[str, set[str]] = {}
    for package in FIRST_PARTY_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in sys.stdlib_module_names or top in FIRST_PARTY_PACKAGES:
                        continue
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


# --- (a) declared requirements are met by what is installed -------------------------------------

def test_installed_versions_satisfy_declared_requirements():
    reqs = _requirements()
    assert reqs, "no dependencies parsed from pyproject.toml"
    problems = []
    for req in reqs:
        if _lower_bound(req) is None:
            problems.append(f"{req}: no lower bound")
        try:
            installed = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            problems.append(f"{req}: installed {installed}")
    assert not problems, "\n".join(problems)


def test_installed_metadata_matches_pyproject():
    """The venv's fedppl was installed from this pyproject.toml (reinstall after editing it)."""
    project = _pyproject()["project"]
    declared = {str(Requirement(r)) for r in project.get("dependencies", [])}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        declared |= {str(Requirement(f'{r}; extra == "{extra}"')) for r in reqs}
    installed = {str(Requirement(r)) for r in md.requires(DIST) or []}
    assert installed == declared, (
        f"stale install: only declared {sorted(declared - installed)}, "
        f"only installed {sorted(installed - declared)}; "
        'run: pip install -c constraints.txt -e ".[dev,arviz]"')


# --- (b) constraints.txt pins the declared lower bounds ----------------------------------------

def test_constraints_pin_every_direct_dependency_at_its_lower_bound():
    pins = _constraints()
    problems = []
    for req in _requirements():
        name, low = canonicalize_name(req.name), _lower_bound(req)
        if name not in pins:
            problems.append(f"{req}: not pinned in constraints.txt")
        elif low != pins[name]:
            problems.append(f"{req}: constraints.txt pins {pins[name]}, lower bound is {low}")
    assert not problems, "\n".join(problems)


def test_build_system_setuptools_minimum_is_the_pinned_one():
    """The wheel test below builds with the pinned setuptools, i.e. the build-system minimum."""
    (req,) = [Requirement(r) for r in _pyproject()["build-system"]["requires"]
              if canonicalize_name(Requirement(r).name) == "setuptools"]
    assert _lower_bound(req) == _constraints()["setuptools"], f"{req} vs constraints.txt"
    assert _lower_bound(req) >= Version("77.0.3"), "PEP 639 license strings need setuptools>=77"


def test_jax_stays_on_0_9_2():
    """jaxlib 0.10.x deadlocks batched CPU LAPACK calls (see constraints.txt)."""
    pins = _constraints()
    assert (pins["jax"], pins["jaxlib"]) == (Version("0.9.2"), Version("0.9.2")), pins


# --- (c) typed package, license, URLs ----------------------------------------------------------

def test_py_typed_in_source_and_installed_package():
    assert (ROOT / "fedppl" / "py.typed").is_file()
    spec = importlib.util.find_spec("fedppl")  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations
    assert (Path(spec.submodule_search_locations[0]) / "py.typed").is_file()
    package_data = _pyproject().get("tool", {}).get("setuptools", {}).get("package-data", {})
    assert "py.typed" in package_data.get("fedppl", []), "add it to [tool.setuptools.package-data]"


def test_installed_metadata_license_urls_and_entry_point():
    meta = md.metadata(DIST)
    assert meta["License-Expression"] == LICENSE, f"installed: {meta['License-Expression']}"
    assert _pyproject()["project"]["license"] == LICENSE, "license must be an SPDX string"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    for label in URL_LABELS:
        assert urls.get(label, "").startswith("https://"), f"missing project URL {label}"
    assert "Typing :: Typed" in (meta.get_all("Classifier") or [])
    (script,) = [e for e in md.entry_points(group="console_scripts") if e.name == "fedppl"]
    from fedppl.cli import main

    assert script.load() is main


def test_wheel_ships_py_typed_and_builds_without_setuptools_warnings(tmp_path):
    """Build a wheel from a copy of the sources with the installed (pinned) setuptools."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in FIRST_PARTY_PACKAGES:
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    script = (
        "import json, warnings\n"
        "from setuptools.warnings import SetuptoolsWarning\n"
        "from setuptools import build_meta\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always', SetuptoolsWarning)\n"
        "    name = build_meta.build_wheel('dist')\n"
        "bad = [f'{w.category.__name__}: {w.message}' for w in caught\n"
        "       if issubclass(w.category, SetuptoolsWarning)]\n"
        "print('RESULT ' + json.dumps({'wheel': name, 'warnings': bad}))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert not result["warnings"], "\n".join(result["warnings"])
    with zipfile.ZipFile(src / "dist" / result["wheel"]) as whl:
        names = set(whl.namelist())
        assert "fedppl/py.typed" in names, "fedppl/py.typed is not in the wheel"
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(meta_name))
    assert meta["License-Expression"] == LICENSE, meta["License-Expression"]
    assert meta["License"] is None, "legacy License field set (license as a TOML table?)"
    assert not [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    labels = {u.split(", ", 1)[0] for u in meta.get_all("Project-URL") or []}
    assert labels >= set(URL_LABELS), f"project URLs missing: {set(URL_LABELS) - labels}"


# --- (d) imports are declared, declarations are imported ---------------------------------------

def test_every_third_party_import_is_a_declared_runtime_dependency():
    imports = _third_party_imports()
    assert {"jax", "numpy", "numpyro"} <= imports.keys(), "import scan found too little"
    providers = _packages_distributions()
    allowed = _runtime_distributions()
    problems = []
    for module, files in sorted(imports.items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists:
            problems.append(f"{module} (in {sorted(files)[0]}): no installed distribution")
        elif not dists & allowed:
            problems.append(f"{module} (in {sorted(files)[0]}): from {sorted(dists)}, "
                            "not in project.dependencies or a non-dev extra")
    assert not problems, "\n".join(problems)


def test_every_declared_runtime_dependency_is_imported():
    imported = _third_party_imports().keys()
    providers = _packages_distributions()
    used = {canonicalize_name(d) for m in imported for d in providers.get(m, [])}
    unused = sorted(_runtime_distributions() - used)
    assert not unused, f"declared but never imported by fedppl/fedppl_experiments: {unused}"
