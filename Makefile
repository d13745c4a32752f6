# torchdoctor developer commands. `make demo` and `make test` set up everything they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# The CPU build of torch; an unpinned torch would pull a CUDA build of several GB.
TORCH_PIN := torch==2.13.0

.PHONY: setup browser demo test lint bench clean

$(STAMP):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test]' $(TORCH_PIN)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

# Headless Chromium for the HTML report tests (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi; }

demo: setup
	$(BIN)/torchdoctor run -- $(BIN)/python examples/train.py

lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

test: setup browser lint
	$(BIN)/pytest -q --durations=15

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) torchdoctor-runs .pytest_cache
