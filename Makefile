# piper_nb: every target creates .venv when missing and installs what it needs (idempotent).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
SYSDEPS := $(VENV)/.sysdeps

.PHONY: test test-all check demo lab lint docs screenshots bench fuzz gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(SYSDEPS): | $(BIN)/python
	@if ! command -v dot >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq graphviz chromium >/dev/null; \
	  else echo "warning: install graphviz and chromium (apt-get install graphviz chromium) for DAG drawing and browser tests"; fi; \
	fi
	@touch $@

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[all,test]"
	@touch $@

# everything, notebooks included: before a change is done, and what CI runs
test: $(STAMP) $(SYSDEPS)
	$(BIN)/ruff check piper_nb tests benchmarks
	$(BIN)/python -m pytest -q -p no:cacheprovider --tier test tests
	$(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env --nbval-cell-timeout=300 notebooks

# what CI leaves out besides: the tests marked `extended` (tests/conftest.py)
test-all: test
	$(BIN)/python -m pytest -q -p no:cacheprovider -m extended tests

# the loop of editing (a few minutes): ruff, every in-process test, the first case of each
# test that starts workers, the README example (tests/conftest.py says what is left out)
check: $(STAMP) $(SYSDEPS)
	$(BIN)/ruff check piper_nb tests benchmarks
	$(BIN)/python -m pytest -q -p no:cacheprovider --tier check tests

demo: $(STAMP) $(SYSDEPS)
	$(BIN)/python -m piper_nb run examples/pp2_dp2_zero3.json --model tiny_gpt --devices 4 --steps 5 --out demo_out

lab: $(STAMP) $(SYSDEPS)
	$(BIN)/jupyter lab --ip 127.0.0.1 --no-browser $$( [ "$$(id -u)" = 0 ] && echo --allow-root ) notebooks

# the documentation site into docs/_build/html (warnings are errors); the notebooks are
# pages with their stored outputs, never executed here
docs: $(STAMP) $(SYSDEPS)
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

# the Designer's screenshots the docs show: the browser test saves fresh ones into the ignored
# artifacts/screenshots/ (tests never rewrite tracked files); this copies them over the
# committed docs/_static/designer.png, search.png (the Search tab) and designer/, a
# screenshot per tab for the Designer guide (docs/designer.md)
screenshots: $(STAMP) $(SYSDEPS)
	rm -f artifacts/screenshots/designer.png
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs tests/ui/test_browser.py
	@test -f artifacts/screenshots/designer.png || { echo "no screenshot: the browser test was skipped (above)"; exit 1; }
	cp artifacts/screenshots/designer.png docs/_static/designer.png
	cp artifacts/screenshots/tabs/search.png docs/_static/search.png
	mkdir -p docs/_static/designer
	cp artifacts/screenshots/tabs/*.png docs/_static/designer/

lint: $(STAMP)
	$(BIN)/ruff check piper_nb tests benchmarks

# the differential fuzzer: CASES random model x strategy cases against one process
# (make fuzz SEED=N replays one case; COMM=nccl-emulated runs them under NCCL's semantics)
CASES ?= 500
fuzz: $(STAMP)
	$(BIN)/python tests/fuzz/run.py $(if $(SEED),--seed $(SEED),--cases $(CASES)) $(if $(COMM),--comm $(COMM))

# everything only a GPU shows, one table (a dry run without CUDA: what it would run)
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_compile.py

clean:
	rm -rf $(VENV) build dist *.egg-info docs/_build docs/notebooks docs/_static/figures
