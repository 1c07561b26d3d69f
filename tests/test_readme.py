"""Every Python example in README.md and on the documentation site runs as written, in float32
and in float64.

The examples are read from the texts themselves: every fenced ``python`` block of README.md, and
every executed ``{code-cell}`` block of the site's hand-written pages (``docs/**/*.md``; the
generated gallery and API pages are not read, and a site page's plain ``python`` blocks are
illustrations the build does not run). The HTML comment just before a block says what to do
with it:

* ``<!-- not-run: reason -->``: a fragment that is not meant to run on its own (kept few);
* ``<!-- readme-test: name=pvi sd=0.2 -->``: run the block with x64 off (float32, inside
  ``jax.enable_x64(False)``, as in ``tests/float32/conftest.py``) and with x64 on (float64),
  each in a fresh namespace, and compare what the block leaves behind between the two:

  - ``compare=NAME`` (default ``result``) names the variable compared; :func:`_summary` turns
    it into numbers (a result's posterior mean over the flat unconstrained vector, with the
    posterior sd as its scale; an array or a tuple of arrays as they are);
  - ``sd=T``: the float32 mean is within ``T`` posterior sds (float64's) of the float64 mean;
    ``rtol=R atol=A``: ``numpy.allclose`` semantics. The tolerances are the method's Monte Carlo
    error between two runs whose random draws differ (JAX draws other numbers in float32), or
    round-off where the method is deterministic;
  - ``float32=refuses``: the float32 run must raise the method's documented refusal, an error
    naming ``numpyro.enable_x64()``;
  - ``after=NAME``: the block continues the example ``NAME`` (runs in a copy of its namespace);
  - ``torch``: a Pyro example: float32/float64 is torch's default dtype, not JAX's flag;
  - ``slow=TEXT``: in the fast suite the block runs up to the first line containing ``TEXT``
    (a Flower simulation starts Ray: tens of seconds); ``FEDPPL_README_FULL=1`` runs it all;
  - ``xfail32=reason``: a float32 run that fails today because of a library bug (kept only
    while the bug is being fixed).

Blocks with neither comment fail the test: each example is either run or says why not. Each
example runs once per dtype per session (its namespace is cached for ``after=``), in a scratch
directory, with its output captured; one that needs an extra (Pyro, Flower, ArviZ) is skipped
without it. ``FEDPPL_README_REPORT=PATH`` appends each example's float32-float64 difference to
``PATH`` (the figures in the README's float32 section).

Cost: every example compiles its own programs twice (once per dtype), so the file is
compile-bound: 58 examples (1 in the README, 57 on the site) take 204 s in one process with
the suite's XLA flags on this 2-core VM, quiet (the README's 20 examples alone took 224 s under
load before the site); 0.01 to 19 s per example.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# generated at build time (the gallery's pages run in the build; the API pages hold no examples)
GENERATED = ("_build", "gallery/tutorials", "gallery/models", "api/generated")
FULL = os.environ.get("FEDPPL_README_FULL") == "1"

# a block and the HTML comments right above it (a comment never runs past its own "-->")
_BLOCK = re.compile(r"((?:[ \t]*<!--(?:(?!-->).)*-->[ \t]*\n)*)```python\n(.*?)^```",
                    re.S | re.M)
# an executed cell of a MyST page: its options (":tags: ..." lines or a "---" block) are not code
_CELL = re.compile(r"((?:[ \t]*<!--(?:(?!-->).)*-->[ \t]*\n)*)```\{code-cell\}[^\n]*\n"
                   r"(?:---\n.*?^---\n|(?::[\w-]+:[^\n]*\n)*)(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!--\s*(readme-test|not-run):?((?:(?!-->).)*)-->", re.S)


class Example:
    def __init__(self, code: str, line: int, markers: str, source: str = "README.md"):
        self.code, self.line, self.source = code, line, source
        self.skip_reason: str | None = None
        self.opts: dict[str, str] = {}
        self.tested = False
        for kind, body in _MARK.findall(markers):
            if kind == "not-run":
                self.skip_reason = body.strip() or "not meant to run"
            else:
                self.tested = True
                for word in shlex.split(body):
                    key, _, value = word.partition("=")
                    self.opts[key] = value
        self.name = self.opts.get("name", f"{source}:{line}")

    @property
    def cut(self) -> bool:
        """Whether the fast suite runs only the block's first lines (``slow=``)."""
        return "slow" in self.opts and not FULL

    def runnable_code(self) -> str:
        if not self.cut:
            return self.code
        slow = self.opts["slow"]
        lines = self.code.splitlines()
        cut = next((i for i, text in enumerate(lines) if slow in text), len(lines))
        return "\n".join(lines[:cut]) + "\n"


def _pages() -> list[Path]:
    """The site's hand-written pages (not the generated ones)."""
    return sorted(p for p in DOCS.rglob("*.md")
                  if not any(p.relative_to(DOCS).as_posix().startswith(g) for g in GENERATED))


def _found(path: Path, pattern: re.Pattern) -> list[Example]:
    text, source = path.read_text(), path.relative_to(ROOT).as_posix()
    return [Example(m.group(2), text.count("\n", 0, m.start(2)) + 1, m.group(1), source)
            for m in pattern.finditer(text)]


def _examples() -> list[Example]:
    return _found(README, _BLOCK) + [e for page in _pages() for e in _found(page, _CELL)]


EXAMPLES = _examples()
BY_NAME = {e.name: e for e in EXAMPLES}
RUN = [e for e in EXAMPLES if e.tested]


def test_every_block_is_run_or_says_why_not():
    assert RUN, "no README example found"
    loose = [f"{e.source}:{e.line}" for e in EXAMPLES if not e.tested and e.skip_reason is None]
    assert not loose, f"python blocks {loose} have no readme-test/not-run mark"
    names = [e.name for e in EXAMPLES]
    assert len(BY_NAME) == len(EXAMPLES), \
        f"two examples share a name: {sorted({n for n in names if names.count(n) > 1})}"
    skipped = [e for e in EXAMPLES if e.skip_reason is not None]
    assert len(skipped) <= 4, "keep the examples that are not run few"
    cells = [e for e in EXAMPLES if e.source != "README.md"]
    assert cells, "no executed cell found on the documentation site"
    assert not [e for e in cells if e.skip_reason], "a site page's executed cell always runs"


def test_the_cell_pattern_reads_a_cell_with_options():
    text = ("<!-- readme-test: name=a sd=1 -->\n```{code-cell} ipython3\n:tags: [hide-output]\n"
            "x = 1\n```\n\n<!-- readme-test: name=b after=a atol=0 -->\n```{code-cell}\n---\n"
            "tags: [remove-cell]\n---\ny = x\n```\n")
    found = [(m.group(2), Example(m.group(2), 0, m.group(1)).opts) for m in _CELL.finditer(text)]
    assert found == [("x = 1\n", {"name": "a", "sd": "1"}),
                     ("y = x\n", {"name": "b", "after": "a", "atol": "0"})]


@contextlib.contextmanager
def _dtype(example: Example, x64: bool):
    if "torch" in example.opts:
        import torch

        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64 if x64 else torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(before)
    else:
        with jax.enable_x64(x64):
            yield


def _namespace(name: str, x64: bool, cache: dict) -> dict:
    """The namespace that example ``name`` leaves behind (run once per dtype per module), run
    in a scratch directory (an example may write files, e.g. ``run.json``)."""
    key = (name, x64)
    if key not in cache:
        example = BY_NAME[name]
        ns = dict(_namespace(example.opts["after"], x64, cache)) if "after" in example.opts \
            else {"__name__": f"readme_{name.replace('-', '_')}"}
        with _dtype(example, x64), contextlib.chdir(cache["cwd"]), \
                contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(example.runnable_code(), f"{example.source}:{example.line}", "exec"), ns)
        ns["__stdout__"] = out.getvalue()
        if "matplotlib.pyplot" in sys.modules:  # figures an example drew
            sys.modules["matplotlib.pyplot"].close("all")
        cache[key] = ns
    return cache[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return {"cwd": tmp_path_factory.mktemp("readme")}


def _summary(value) -> tuple[np.ndarray, np.ndarray | None]:
    """Numbers to compare and, for a posterior, their scale (the posterior sd)."""
    if hasattr(value, "mean_and_cov"):  # a covariance, or a mean-field guide's variances
        mean, cov = (np.asarray(a, np.float64) for a in value.mean_and_cov())
        return mean.ravel(), np.sqrt(np.diag(cov) if cov.ndim == 2 else cov.ravel())
    if hasattr(value, "select_dtypes"):  # a pandas table (an ArviZ summary)
        value = value.select_dtypes("number").to_numpy()
    if isinstance(value, dict):
        value = [value[k] for k in sorted(value)]
    if isinstance(value, (tuple, list)):
        return np.concatenate([np.asarray(v, np.float64).ravel() for v in value]), None
    return np.asarray(value, np.float64).ravel(), None


def _compare(example: Example, ns32: dict, ns64: dict) -> str:
    """Assert float32's summary is within the example's tolerance of float64's; return the
    difference found, in words (``FEDPPL_README_REPORT=PATH`` collects them)."""
    name = example.opts.get("compare", "result")
    (a, _), (b, scale) = _summary(ns32[name]), _summary(ns64[name])
    assert a.shape == b.shape
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), "non-finite summary"
    if "sd" in example.opts:
        assert scale is not None, f"{name} has no posterior sd; use rtol/atol"
        z = np.max(np.abs(a - b) / scale)
        assert z <= float(example.opts["sd"]), \
            f"float32 is {z:.3g} posterior sd from float64 (allowed {example.opts['sd']})"
        return f"{z:.2g} posterior sd (allowed {example.opts['sd']})"
    np.testing.assert_allclose(a, b, rtol=float(example.opts.get("rtol", 1e-7)),
                               atol=float(example.opts.get("atol", 0.0)))
    return f"{np.max(np.abs(a - b)):.2g} absolute in {name}"


# an example that needs an extra is skipped where the extra is not installed
EXTRAS = {"fedppl.pyro": "pyro", "fedppl.runtime.flower": "flwr", "arviz_stats": "arviz_stats"}


def _needs(example: Example) -> list[str]:
    code = example.code + (BY_NAME[example.opts["after"]].code if "after" in example.opts else "")
    return [module for name, module in EXTRAS.items() if name in code]


@pytest.mark.parametrize("example", RUN, ids=lambda e: e.name)
def test_readme_example(example, runs):
    for module in _needs(example):
        pytest.importorskip(module, reason=f"this example needs {module} (an extra)")
    ns64 = _namespace(example.name, True, runs)
    if example.opts.get("float32") == "refuses":
        with pytest.raises(Exception, match=r"enable_x64"):
            _namespace(example.name, False, runs)
        return
    if "xfail32" in example.opts:
        try:
            ns32 = _namespace(example.name, False, runs)
            _compare(example, ns32, ns64)
        except Exception as err:  # a known float32 bug, reported as xfail
            pytest.xfail(f"float32: {example.opts['xfail32']} ({type(err).__name__}: {err})")
        return
    ns32 = _namespace(example.name, False, runs)
    if example.cut:  # the fast suite ran the set-up only: it ran in both dtypes, nothing to compare
        return
    found = _compare(example, ns32, ns64)
    if os.environ.get("FEDPPL_README_REPORT"):
        with open(os.environ["FEDPPL_README_REPORT"], "a") as f:
            f.write(f"{example.name}: {found}\n")


def test_the_comparison_can_fail():
    """The harness's comparison refuses a float32 answer off by more than its tolerance."""
    example = Example("result = 1\n", 1, "<!-- readme-test: name=t sd=0.1 -->")

    class Posterior:
        def __init__(self, mean):
            self.mean = mean

        def mean_and_cov(self):
            return np.array([self.mean, 0.0]), np.eye(2)

    _compare(example, {"result": Posterior(0.05)}, {"result": Posterior(0.0)})
    with pytest.raises(AssertionError, match="posterior sd"):
        _compare(example, {"result": Posterior(0.2)}, {"result": Posterior(0.0)})
    with pytest.raises(AssertionError, match="non-finite"):
        _compare(example, {"result": Posterior(np.nan)}, {"result": Posterior(0.0)})
    close = Example("", 1, "<!-- readme-test: name=u compare=m atol=0.01 -->")
    with pytest.raises(AssertionError):
        _compare(close, {"m": (np.ones(2), np.zeros(2))}, {"m": (np.ones(2) + 0.1, np.zeros(2))})
