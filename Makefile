# Two commands do all the set-up on a fresh machine:
#   make demo   - create/refresh .venv, install fedppl (no extras), run the federated demo (table + plot)
#   make test   - create/refresh .venv, install fedppl with every extra, lint, type check, run
#                 the test suite and the docstring examples
#   make docs   - build the documentation site into docs/_build/html (every example executed,
#                 warnings as errors), then look at it in headless Chromium (docs/_tests)
#   make bench  - the benchmark suite, quick (BENCH=NAME for one, SIZE=full for the committed runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed
# pytest-xdist workers; --dist loadfile keeps each test file (and its fixtures) on one worker
TEST_JOBS ?= 2

.PHONY: demo test docs bench clean

# Two stamps: `make demo` installs fedppl alone (JAX, NumPyro and the base dependencies: what
# the demo runs), `make test` adds every extra (ArviZ, Flower with Ray, the Pyro port with torch).
$(BASE): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e .
	touch $(BASE)

$(STAMP): $(BASE)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,arviz,flower,pyro,docs]"
	touch $(STAMP)

demo: $(BASE)
	$(BIN)/fedppl demo

# The suite is compile-bound (hundreds of small programs, each run briefly). Three XLA:CPU flags
# make compiling cheaper and change only floating-point round-off, which every test tolerates:
# the lower optimisation level (about 17% of the suite's time), XLA's older elemental emitter
# for fused loops instead of its MLIR fusion emitters (about a third less CPU on the
# compile-heavy files), and one LLVM module per program instead of several compiled on threads
# (about 17% less compile CPU for a PVI round, where two test workers already share two
# cores). Benchmarks and the library run with XLA's defaults.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false \
	--xla_cpu_parallel_codegen_split_count=1

# lint, type check, then the tests and the docstring examples (pytest --doctest-modules), with
# the 20 slowest listed at the end (where to look when the suite grows)
test: $(STAMP)
	$(BIN)/ruff check fedppl fedppl_experiments tests benchmarks tutorials examples docs
	$(BIN)/mypy
	OPENBLAS_NUM_THREADS=1 XLA_FLAGS="$(TEST_XLA_FLAGS)" $(BIN)/python -m pytest \
		-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=20

# The site: -E reads every page afresh (so -W sees every warning); the examples' outputs are
# cached in docs/_build/.jupyter_cache and re-executed only when a page's code changes (a fresh
# clone executes them all). The browser test needs Debian's chromium (apt-get install chromium).
# The examples are compile-bound too: their kernels take the test suite's XLA flags (round-off
# only; about a third less CPU), as DOCS_XLA_FLAGS.
DOCS_JOBS ?= 2
DOCS_XLA_FLAGS ?= $(TEST_XLA_FLAGS)
# MathJax 3 from the npm registry, served by the site itself (it renders offline); without npm
# the pages load it from MathJax's CDN
MATHJAX := docs/_build/mathjax/node_modules/mathjax/es5/tex-mml-chtml.js
$(MATHJAX):
	command -v npm > /dev/null && npm install --silent --no-audit --no-fund \
		--prefix docs/_build/mathjax mathjax@3.2.2 || echo "make docs: no npm, MathJax from its CDN"

docs: $(STAMP) $(MATHJAX)
	@test -x /usr/bin/chromium || { echo "make docs: the browser test needs /usr/bin/chromium" \
		"(Debian: apt-get install chromium)"; exit 1; }
	OPENBLAS_NUM_THREADS=1 XLA_FLAGS="$(DOCS_XLA_FLAGS)" $(BIN)/sphinx-build -W --keep-going -E \
		-j $(DOCS_JOBS) -b html \
		docs docs/_build/html
	$(BIN)/python -m pytest -q -p no:cacheprovider docs/_tests

# The benchmark suite (benchmarks/__main__.py; `python -m benchmarks --list` lists it): every
# benchmark at its quick size by default, into benchmarks/results/quick/ (git-ignored, so the
# committed results the docs cite stay as they are); BENCH=NAME runs one, SIZE=full the runs
# behind the committed results (then `make docs` renders their pages).
BENCH ?= all
SIZE  ?= quick
bench: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m benchmarks $(BENCH) --size $(SIZE)

clean:
	rm -rf $(VENV) .pytest_cache docs/_build docs/gallery/tutorials docs/gallery/models \
		docs/api/generated
