"""Generated gallery sources: the tutorials, and one executable page per gallery model.

Each model page shows the model's source (read from ``examples/gallery/models.py``), simulates
its ten clients with the entry's own ``make_data``, runs PVI, and prints the posterior summary
beside the check against the pooled posterior (Pareto k-hat of one more exchange), so each
page carries its own trust diagnostic. The NUTS comparison is the ``model_gallery`` benchmark
page.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FRONT = """---
file_format: mystnb
kernelspec:
  name: python3
  display_name: Python 3
  language: python
---
"""

MODEL_PAGE = FRONT + """
# {title}

{description}

The model, as `examples/gallery/models.py` writes it: nothing in it knows about federation.

```python
{source}
```

Ten clients of uneven sizes with shifted covariates (the entry's `make_data(0)`), then PVI
with a {family} Gaussian guide{local_note}:

```{{code-cell}} ipython3
import jax
import numpy as np

import fedppl
from examples.gallery import GALLERY
from fedppl.guides import PVIGuide

jax.config.update("jax_enable_x64", True)

entry = GALLERY["{name}"]
arrays, model_kwargs = entry.make_data(0)
clients = fedppl.Clients.from_list(arrays)
print("client sizes:", [len(a[-1]) for a in arrays], " static arguments:", model_kwargs)

guide = PVIGuide(entry.model, global_sites=entry.global_sites, family=entry.family)
result = fedppl.PVI(entry.model, guide, damping=1.0).run(
    jax.random.key(0), clients, num_rounds=30, tol=1e-8, progress_bar=False, **model_kwargs)
print(f"{{result.num_rounds}} rounds")
```

The posterior of the global sites (draws of q, summarised by ArviZ):

```{{code-cell}} ipython3
from arviz_stats import summary

summary(result.to_arviz(jax.random.key(1)), kind="stats")
```

How far q is from the posterior of the pooled data: one more exchange, 1,000 draws of the
global sites to every client and their log-likelihoods back (see the user guide's page on
checks). A Pareto k-hat below the threshold says the importance-corrected moments can be
trusted, and a warning is printed when it is not:

```{{code-cell}} ipython3
{check_tags}check = result.check(jax.random.key(2), clients)
print(f"k-hat {{check.khat:.2f}} (threshold {{check.threshold:.2f}}), "
      f"effective sample size {{check.ess:.0f}} of 1000")
```
"""

INDEX = """# Models

Fourteen ordinary NumPyro models from `examples/gallery/` (the models the `model_gallery`
benchmark compares with NUTS on the pooled data: see its page under Benchmarks). Each page
below was executed when this site was built.

```{{toctree}}
:maxdepth: 1

{entries}
```
"""


def _model_source(entry) -> str:
    return inspect.getsource(entry.model).rstrip()


def write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` unless the file already holds exactly that text (an unchanged
    page keeps its cached execution and is not re-read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def generate(srcdir: Path) -> None:
    """Copy the tutorials into ``gallery/tutorials``; write ``gallery/models/<name>.md``."""
    for script in sorted((ROOT / "tutorials").glob("*.py")):
        write(srcdir / "gallery" / "tutorials" / script.name, script.read_text())
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.gallery import GALLERY

    for name, entry in GALLERY.items():
        local = ("" if entry.global_sites is None else
                 f" (global sites {', '.join(f'`{s}`' for s in entry.global_sites)}; every other"
                 " latent site is local to its client and never leaves it)")
        # a model that subsamples its data plate has no exact per-client log-likelihood: the
        # check refuses it, and the page shows the refusal
        subsamples = "subsample_size" in _model_source(entry)
        check_tags = ":tags: [raises-exception]\n" if subsamples else ""
        page = MODEL_PAGE.format(check_tags=check_tags, name=name,
                                 title=name.replace("_", " ").capitalize(),
                                 description=entry.description, source=_model_source(entry),
                                 family=entry.family, local_note=local)
        write(srcdir / "gallery" / "models" / f"{name}.md", page)
    write(srcdir / "gallery" / "models" / "index.md", INDEX.format(entries="\n".join(GALLERY)))
