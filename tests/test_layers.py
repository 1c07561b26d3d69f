"""fedppl's layers point down: the import graph, read from the source with ``ast`` (nothing is
imported), holds to the layer map below.

Layers, bottom up (:data:`LAYERS` is the one place the map lives):

0. base: ``trees``, ``optimise``, ``validation``, ``clients``, ``partition``, ``model_call``,
   ``accounting``, ``privacy``: no import of another layer (``partition`` uses ``clients``,
   ``privacy`` uses ``accounting``);
1. ``families``: the exponential-family algebra;
2. sites: ``sites``, ``conjugacy``: a model's latent and observed sites (they need ``families``;
   the handlers, guides and algorithms need them);
3. ``handlers``;
4. ``models``: ready NumPyro models and their kernels;
5. ``guides``: guides over a model's sites (the sparse-GP guides build on ``models.svgp``, so
   models sit below guides, as in DESIGN's "model -> guide");
6. ``algorithms``: the trios (with ``algorithms.dp_statistics``, the private release of
   ``algorithms.exact``'s statistics that ``algorithms.fedbnr`` and ``algorithms.fsgp`` use);
7. ``runtime``: who runs a trio;
8. front: ``infer``, ``cli``, ``__main__``, ``datasets``, ``metrics``, ``arviz``, ``audit`` and the
   package's ``__init__``;
9. ``pyro``: the Pyro port, over everything.

The rule: a module imports from its own layer or lower ones only. Every import counts: at module
level, under ``TYPE_CHECKING``, and inside functions (a lazy import is still a dependency). The
one exception: inside a function, the optional-extra loaders of the front's ``fedppl.arviz``
(``arviz_base``, ``arviz_stats``, ``arviz_plots``) may be imported from any layer; they load
only the extra (``fedppl.arviz`` imports nothing above base at module level, checked here) and
exist so that a missing extra fails with one message wherever it is needed (PSIS in
``algorithms.importance`` needs ``arviz_stats``).

No circles: no two files import each other, directly or around a longer circle (lazy imports
count), in fedppl and ``fedppl_experiments`` together.

Private names stay in their module: no ``from fedppl.x import _y`` from another module, no
private submodule (``fedppl.handlers._observed``) imported from outside its package, and no
``obj._name`` where ``_name`` is defined in another fedppl module only (``guide._require_setup()``).

The small pytree helpers (``index``, ``first``, ``one``, ``stack``, ``unstack``, ``broadcast``)
exist once, in :mod:`fedppl.trees`: no ``def _index``/``_stack``/``_one``/``_first`` elsewhere,
and no other function whose body is one of theirs.

:data:`KNOWN` lists the offences left in modules being rewritten elsewhere; each test fails on an
offence not in it and on an entry of it that no longer occurs, so it only ever shrinks.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fedppl"

#: The layers, bottom up: a package (every module under it) or a single module per entry.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("fedppl.trees", "fedppl.optimise", "fedppl.validation", "fedppl.clients",
              "fedppl.partition", "fedppl.model_call", "fedppl.accounting", "fedppl.privacy")),
    ("families", ("fedppl.families",)),
    ("sites", ("fedppl.sites", "fedppl.conjugacy")),
    ("handlers", ("fedppl.handlers",)),
    ("models", ("fedppl.models",)),
    ("guides", ("fedppl.guides",)),
    ("algorithms", ("fedppl.algorithms",)),
    ("runtime", ("fedppl.runtime",)),
    ("front", ("fedppl.infer", "fedppl.cli", "fedppl.__main__", "fedppl.datasets",
               "fedppl.metrics", "fedppl.arviz", "fedppl.audit", "fedppl")),
    ("pyro", ("fedppl.pyro",)),
)

#: Lazy imports (inside a function) allowed from any layer: the optional-extra loaders.
EXTRA_LOADERS = {"fedppl.arviz": {"arviz_base", "arviz_stats", "arviz_plots"}}

#: The tree helpers, defined in fedppl.trees only; the names their copies went by.
TREES = "fedppl.trees"
COPY_NAMES = {"_index", "_stack", "_unstack", "_one", "_first", "_take"}

#: Underscore attributes that are other libraries' public protocols, not fedppl's private names:
#: NamedTuple's API and Pyro's Messenger dispatch (``_pyro_sample``...).
PROTOCOL_ATTRIBUTES = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}
PROTOCOL_PREFIXES = ("_pyro_",)

#: Offences allowed for now (none: every module follows the rule). An entry here must still
#: occur, or the tests fail, so the set can only shrink.
KNOWN: set[str] = set()


# -- reading the source ----------------------------------------------------------------------


class Import(NamedTuple):
    importer: str  # the module that imports
    target: str  # the fedppl module it imports from (a package means its __init__)
    name: str | None  # the name imported from it (None: the module itself)
    line: int
    lazy: bool  # inside a function


class Source(NamedTuple):
    name: str  # dotted module name
    tree: ast.Module
    package: bool  # an __init__.py


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_package(root: Path = ROOT) -> dict[str, Source]:
    return {module_name(p): Source(module_name(p), ast.parse(p.read_text(), str(p)),
                                   p.name == "__init__.py")
            for p in sorted(root.rglob("*.py"))}


def _is_fedppl(name: str) -> bool:
    """A module of fedppl or of its experiments package (whose imports of each other count)."""
    return name.split(".")[0] in ("fedppl", "fedppl_experiments")


def _walk(node: ast.AST, lazy: bool = False):
    """Every node with whether it sits inside a function body."""
    for child in ast.iter_child_nodes(node):
        yield child, lazy
        inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def imports_of(src: Source, modules: set[str]) -> list[Import]:
    """The fedppl imports of one module, with relative imports resolved and ``from pkg import
    sub`` read as an import of the submodule."""
    out = []
    base = src.name if src.package else src.name.rpartition(".")[0]
    for node, lazy in _walk(src.tree):
        if isinstance(node, ast.Import):
            out += [Import(src.name, a.name, None, node.lineno, lazy)
                    for a in node.names if _is_fedppl(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parts = parts[:len(parts) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not _is_fedppl(module):
                continue
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.append(Import(src.name, sub, None, node.lineno, lazy) if sub in modules
                           else Import(src.name, module, a.name, node.lineno, lazy))
    return out


# -- the checks ----------------------------------------------------------------------------------


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a module (its own entry, else its innermost listed package)."""
    best, depth = None, -1
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            covers = module == e or (module.startswith(e + ".") and e != "fedppl")
            if covers and e.count(".") > depth:
                best, depth = i, e.count(".")
    return best


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _allowed_lazy(imp: Import) -> bool:
    return imp.lazy and imp.name in EXTRA_LOADERS.get(imp.target, set())


def upward(imports: list[Import]) -> set[str]:
    """``importer -> target`` for every import from a higher layer."""
    out = set()
    for imp in imports:
        mine, theirs = layer_of(imp.importer), layer_of(imp.target)
        if mine is not None and theirs is not None and theirs > mine and not _allowed_lazy(imp):
            out.add(f"{imp.importer} -> {imp.target}")
    return out


def private_imports(imports: list[Import]) -> set[str]:
    """``importer -> target.name`` for every private name imported from another module, and
    every private submodule imported from outside its package."""
    out = set()
    for imp in imports:
        if imp.name is not None and _private(imp.name) and imp.target != imp.importer:
            out.add(f"{imp.importer} -> {imp.target}.{imp.name}")
        parts = imp.target.split(".")
        for i, part in enumerate(parts):
            package = ".".join(parts[:i])
            if _private(part) and not (imp.importer + ".").startswith(package + "."):
                out.add(f"{imp.importer} -> {imp.target}")
    return out


def _private_definitions(src: Source) -> set[str]:
    """The private functions, classes and ``self._x`` attributes a module defines."""
    out = set()
    for node, _ in _walk(src.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in out if _private(n)}


def private_attributes(sources: dict[str, Source]) -> set[str]:
    """``module: ._name`` where the module reads ``obj._name`` (``obj`` not ``self``/``cls``)
    and ``_name`` is defined by other fedppl modules only."""
    defined = {name: _private_definitions(src) for name, src in sources.items()}
    out = set()
    for name, src in sources.items():
        for node, _ in _walk(src.tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if (node.attr in defined[name] or node.attr in PROTOCOL_ATTRIBUTES
                    or node.attr.startswith(PROTOCOL_PREFIXES)):
                continue
            if any(node.attr in d for other, d in defined.items() if other != name):
                out.add(f"{name}: .{node.attr}")
    return out


def _shape(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """A one-statement function's returned expression, its names numbered in order of
    appearance (so ``lambda x: x[k]`` and ``lambda a: a[i]`` read the same); else None."""
    body = [s for s in fn.body
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None
    names: dict[str, str] = {}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            return ast.Name(names.setdefault(node.id, f"n{len(names)}"))

        def visit_arg(self, node: ast.arg) -> ast.arg:
            return ast.arg(names.setdefault(node.arg, f"n{len(names)}"))

    return ast.dump(Rename().visit(copy.deepcopy(body[0].value)), annotate_fields=False)


def tree_helper_copies(sources: dict[str, Source]) -> set[str]:
    """``module.function`` for every function outside fedppl.trees named as a copy of a tree
    helper, or whose one-line body is a tree helper's."""
    helpers = {s for s in (_shape(f) for f in sources[TREES].tree.body
                           if isinstance(f, ast.FunctionDef)) if s is not None}
    out = set()
    for name, src in sources.items():
        if name == TREES:
            continue
        for node, _ in _walk(src.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    node.name in COPY_NAMES or _shape(node) in helpers):
                out.add(f"{name}.{node.name}")
    return out


def circles(imports: list[Import], modules: set[str]) -> list[list[str]]:
    """The import circles between files: each strongly connected set of two or more modules of
    the graph ``importer -> target`` (every import counts, lazy ones too), sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.target != imp.importer and imp.target in modules:
            graph[imp.importer].add(imp.target)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(found)


def _compare(found: set[str], kind: str) -> None:
    known = {k for k in KNOWN if _kind(k) == kind}
    new, stale = sorted(found - known), sorted(known - found)
    assert not new and not stale, (
        f"{kind}: new offences {new}; KNOWN entries that no longer occur (delete them) {stale}")


def _kind(entry: str) -> str:
    if ": ." in entry:
        return "private attributes"
    if " -> " not in entry:
        return "tree helper copies"
    target = entry.split(" -> ")[1]
    return "private imports" if any(_private(p) for p in target.split(".")) else "upward imports"


# -- the tests on fedppl -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources() -> dict[str, Source]:
    return read_package()


@pytest.fixture(scope="module")
def imports(sources) -> list[Import]:
    modules = set(sources)
    return [imp for src in sources.values() for imp in imports_of(src, modules)]


def test_every_module_has_a_layer(sources):
    assert [m for m in sources if layer_of(m) is None] == []
    assert layer_of("fedppl") == layer_of("fedppl.infer.variational")
    assert layer_of("fedppl.sites") < layer_of("fedppl.handlers.cavity")


def test_no_import_runs_up_the_layers(imports):
    _compare(upward(imports), "upward imports")


def test_private_names_stay_in_their_module(imports, sources):
    _compare(private_imports(imports), "private imports")
    _compare(private_attributes(sources), "private attributes")


def test_tree_helpers_exist_once(sources):
    _compare(tree_helper_copies(sources), "tree helper copies")


def test_no_import_circles_between_files(sources):
    """No two files import each other, directly or around a circle, in fedppl and its
    experiments package together (the command-line interface is the top: the command modules
    register without importing it back)."""
    every = {**sources, **read_package(ROOT.parent / "fedppl_experiments")}
    modules = set(every)
    found = circles([imp for src in every.values() for imp in imports_of(src, modules)],
                    modules)
    assert found == [], found


def test_extra_loaders_import_only_the_base(sources, imports):
    """The exception for lazy imports of fedppl.arviz's loaders holds only while importing
    fedppl.arviz pulls in nothing above the base layer."""
    top = {imp.target for imp in imports
           if imp.importer in EXTRA_LOADERS and not imp.lazy
           and not _under_type_checking(sources[imp.importer].tree, imp.line)}
    assert all(layer_of(t) == 0 for t in top), top


def _under_type_checking(tree: ast.Module, line: int) -> bool:
    return any(isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING")
               and n.lineno <= line <= (n.end_lineno or n.lineno) for n in ast.walk(tree))


# -- the checker can fail ------------------------------------------------------------------------


FAKE = {
    "fedppl.families.fake": '''
from fedppl.families import gaussian
from fedppl.algorithms.pvi import PVIState        # families -> algorithms: up
from fedppl.clients import _pad                   # a private name of another module

def f():
    from fedppl.infer import variational          # lazy, still up
    from fedppl.arviz import arviz_stats          # an extra's loader: allowed
    return result._client_index(0, 1)             # another module's private method

def _index(tree, k):                              # a copy of trees.index by name
    return tree

def take(tree, i):                                # ... and by body
    return jax.tree_util.tree_map(lambda a: a[i], tree)
''',
    "fedppl.handlers.fake": "from fedppl.handlers import _observed\n",
    "fedppl.models.fake": "from fedppl.handlers._observed import observation\n",
}


def test_the_checker_reports_a_fake_upward_edge(sources):
    fake = {**sources, **{name: Source(name, ast.parse(text), False)
                          for name, text in FAKE.items()}}
    modules = set(fake)
    imports = [imp for name in FAKE for imp in imports_of(fake[name], modules)]
    assert upward(imports) == {"fedppl.families.fake -> fedppl.algorithms.pvi",
                               "fedppl.families.fake -> fedppl.infer.variational"}
    assert private_imports(imports) == {
        "fedppl.families.fake -> fedppl.clients._pad",
        "fedppl.models.fake -> fedppl.handlers._observed"}  # inside its package: allowed
    assert "fedppl.families.fake: ._client_index" in private_attributes(fake)
    copies = tree_helper_copies(fake)
    assert {"fedppl.families.fake._index", "fedppl.families.fake.take"} <= copies
    with pytest.raises(AssertionError, match="new offences"):
        _compare(upward(imports), "upward imports")


def test_the_checker_finds_a_fake_circle():
    """Three files around a circle (one import lazy) and a pair: two circles; a chain: none."""
    text = {"fedppl.x.a": "from fedppl.x import b\n",
            "fedppl.x.b": "def f():\n    from fedppl.x.c import g\n",
            "fedppl.x.c": "import fedppl.x.a\n",
            "fedppl_experiments.p": "from fedppl_experiments import q\n",
            "fedppl_experiments.q": "from fedppl_experiments.p import run\n",
            "fedppl.y.chain": "from fedppl.x import a\n"}
    fake = {name: Source(name, ast.parse(body), False) for name, body in text.items()}
    modules = set(fake)
    imports = [imp for src in fake.values() for imp in imports_of(src, modules)]
    assert circles(imports, modules) == [["fedppl.x.a", "fedppl.x.b", "fedppl.x.c"],
                                         ["fedppl_experiments.p", "fedppl_experiments.q"]]
