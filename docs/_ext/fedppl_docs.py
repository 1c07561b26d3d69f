"""The documentation site's own Sphinx extension.

* the examples gallery: copies ``tutorials/*.py`` into ``gallery/tutorials/`` and writes one
  executable page per model of ``examples.gallery`` into ``gallery/models/`` (both generated at
  each build, not committed), so the gallery cannot drift from the tutorials the tests run;
* the benchmark pages' tables and plots (:mod:`benchpages`), read from
  ``benchmarks/results/*.json`` at build time.

A generated file is rewritten only when its text changes, so an unchanged tutorial keeps its
cached execution.
"""

from __future__ import annotations

from pathlib import Path

import benchpages
import gallerygen


def _generate(app, config) -> None:
    gallerygen.generate(Path(app.srcdir))


def setup(app):
    app.connect("config-inited", _generate)
    benchpages.setup(app)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
