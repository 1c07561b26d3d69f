"""Sphinx configuration of fedppl's documentation site (``make docs``).

Pages are MyST markdown. Pages with ``{code-cell}`` blocks, and the tutorials of
``tutorials/`` (jupytext percent scripts), are executed by myst-nb at build time; executed
outputs are cached in ``docs/_build/.jupyter_cache`` between local builds (a fresh clone, as in
CI, executes everything). Benchmark tables and plots are generated from
``benchmarks/results/*.json`` by the ``fedppl_docs`` extension in ``docs/_ext``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(ROOT))  # examples.gallery, fedppl from the checkout

import fedppl  # noqa: E402

# the executed pages' kernels import examples.gallery from the checkout
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
# tqdm.auto picks its notebook bar in a kernel and warns that ipywidgets is missing: the pages
# run with progress_bar=False, so the warning says nothing about them
os.environ["PYTHONWARNINGS"] = "ignore:IProgress not found"

project = "fedppl"
author = "fedppl developers"
copyright = "2026, fedppl developers"
release = version = fedppl.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "sphinx_design",
    "fedppl_docs",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "_ext", "_tests", "_templates", "conf.py"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

# --- MyST and notebook execution -----------------------------------------------------------
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist", "substitution"]
myst_heading_anchors = 3
# the tutorials are jupytext percent scripts; myst-nb reads them through jupytext
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = os.environ.get("FEDPPL_DOCS_EXECUTE", "cache")  # "force" re-runs all
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_in_temp = True  # figures the examples save land in a scratch directory
nb_execution_timeout = 900
nb_execution_raise_on_error = True  # an example that fails fails the build
nb_execution_show_tb = True
nb_merge_streams = True
nb_kernel_rgx_aliases = {".*": "python3"}

# --- API reference ------------------------------------------------------------------------
autosummary_generate = True
templates_path = ["_templates"]  # docs/_templates/autosummary: class, module, function pages
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"

# --- HTML ---------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "fedppl"
html_static_path = ["_static"]
html_css_files = ["fedppl.css"]
# MathJax served by the site (make docs installs it from the npm registry): its one-file
# TeX/MathML build and the fonts it loads from beside itself; else MathJax's CDN (the default)
MATHJAX = DOCS / "_build" / "mathjax" / "node_modules" / "mathjax" / "es5"
if (MATHJAX / "tex-mml-chtml.js").exists():
    _served = DOCS / "_build" / "mathjax_static"
    _fonts = Path("output", "chtml", "fonts", "woff-v2")
    shutil.rmtree(_served, ignore_errors=True)
    shutil.copytree(MATHJAX / _fonts, _served / "mathjax" / _fonts)
    shutil.copy(MATHJAX / "tex-mml-chtml.js", _served / "mathjax")
    html_static_path.append(str(_served))
    mathjax_path = "mathjax/tex-mml-chtml.js"
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "secondary_sidebar_items": ["page-toc", "sourcelink"],
}
html_sidebars = {"index": [], "getting-started": []}
html_last_updated_fmt = None
