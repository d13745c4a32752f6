# torchdoctor developer commands. `make demo` and `make test` set up everything they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Installed again when the project's metadata or the agent's compiled fast path changes (an
# editable install builds _fast.c into the source tree once, at install).
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py src/torchdoctor/instrument/agent/_fast.c | sha1sum | cut -c1-12)
# The CPU build of torch; an unpinned torch would pull a CUDA build of several GB.
TORCH_PIN := torch==2.13.0

.PHONY: setup system venv-prerequisites demo test lint docs bench clean

# Debian and Ubuntu ship venv's ensurepip in a package of its own: without python3-venv,
# `python3 -m venv` makes a venv with no pip in it and fails.
venv-prerequisites:
	@$(PY) -c 'import ensurepip, venv' 2>/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq python3-venv >/dev/null; }

# pip >= 25.1 reads the development tools from pyproject's [dependency-groups] (PEP 735).
$(STAMP): | venv-prerequisites
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade 'pip>=25.1'
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[all]' --group dev $(TORCH_PIN)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

# Debian packages the tests drive for real: headless Chromium (HTML report), tmux (top at 80x24),
# Slurm with munge (a one-node cluster for sbatch), Prometheus (scraping the exporter), iproute2
# (network namespaces and tc for two-node tests), systemd (systemd-analyze verify of the queue's
# units), the C compiler and Python's headers (the fake libnvidia-ml.so.1 of tests/nvml/, the
# agent's compiled fast path, built by `setup`). py-spy (attach's stack sampler) is not a Debian
# package here: it comes from PyPI as a base dependency of the package, into .venv/bin, where
# sampling/pystacks.py looks first. Each is checked by the program it provides; with CI=true a test whose engine is
# missing fails instead of skipping (tests/helpers/engines.py).
# Chromium: Debian's `chromium` package. On Ubuntu `apt-get install chromium` installs a snap
# stub that does not run headless in a container or CI: install Google Chrome's .deb instead
# (https://dl.google.com/linux/direct/google-chrome-stable_current_amd64.deb, `apt-get install
# ./google-chrome-stable_current_amd64.deb`); the tests find chromium, chromium-browser or
# google-chrome(-stable) on PATH.
SYSTEM_PACKAGES := chromium:chromium tmux:tmux slurmctld:slurm-wlm sbatch:slurm-client \
	munged:munge prometheus:prometheus ip:iproute2 tc:iproute2 cc:gcc \
	systemd-analyze:systemd
system:
	@missing=""; for pair in $(SYSTEM_PACKAGES); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || [ -x /usr/sbin/$${pair%%:*} ] || missing="$$missing $${pair##*:}"; \
	done; \
	$(PY) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	  || missing="$$missing python3-dev"; \
	if [ -n "$$missing" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

demo: setup
	$(BIN)/torchdoctor run -- $(BIN)/python examples/train.py

# ruff also guards the NVML choke point and keeps torch out of module-level imports; the
# import-linter contracts in pyproject.toml guard the package layers.
lint: setup
	$(BIN)/ruff check src tests benchmarks examples docs
	$(BIN)/ruff format --check src tests benchmarks examples docs
	$(BIN)/lint-imports --no-cache
	$(MAKE) docs

# The manual (docs/, Sphinx): strict, so a warning, a broken link or a page left out of the
# table of contents fails. The man pages come from the same source into man/, which the wheel
# installs as share/man/man1.
SPHINX := $(BIN)/python -m sphinx -q -W --keep-going -n
docs: setup
	$(SPHINX) -b html docs docs/_build/html
	$(SPHINX) -b man docs docs/_build/man
	mkdir -p man && cp docs/_build/man/*.1 man/

# system first: the C compiler it installs builds the agent's compiled path at setup.
test: system setup lint
	$(BIN)/pytest -q --durations=15

bench: setup
	$(BIN)/python benchmarks/run_all.py

# The property-based fuzz suite (tests/fuzz/) at length: FUZZ_EXAMPLES random examples a test
# (a normal test run draws a few dozen, always the same); failing inputs are saved in
# tests/fuzz/examples/, which every later `make fuzz` replays first.
FUZZ_EXAMPLES ?= 2000
.PHONY: fuzz
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -q -p no:cacheprovider --timeout=0 tests/fuzz

clean:
	rm -rf $(VENV) torchdoctor-runs .pytest_cache docs/_build docs/reference
