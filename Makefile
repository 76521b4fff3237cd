# The two quick-start commands: `make run` (set up, then server + worker) and `make test`
# (set up, then ruff, mypy and the whole test suite). Both create ./.venv on first use.
# The project needs Python 3.11 (requires-python): python3.11 where it is on PATH, else python3,
# and a clear error before anything is installed when that is another version.
PYTHON ?= $(shell command -v python3.11 || echo python3)
VENV ?= .venv
BIN := $(VENV)/bin
define need_311
	@$(1) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || { \
	  echo "trainyard needs Python 3.11; $(1) is: $$(command -v $(1) >/dev/null && $(1) --version 2>&1 || echo not found)." >&2; \
	  echo "Install it (apt install python3.11 python3.11-venv, or uv python install 3.11, or pyenv install 3.11)" >&2; \
	  echo "and name it: make $(MAKECMDGOALS) PYTHON=\$$(uv python find 3.11)  (or PYTHON=\$$(pyenv prefix 3.11)/bin/python)" >&2; \
	  $(2) exit 1; }
endef

# Free space before the big installs: torch's CUDA builds fill several GB, and pip unpacks them under TMPDIR first.
# A clear error before a download, naming what is needed, rather than pip's "No space left on device" halfway.
# $(1) what is installed, $(2) GB it takes where the venv is, $(3) GB pip unpacks under TMPDIR (same disk: the sum),
# $(4) a command that succeeds where it is installed already (no check then).
define need_space
	@$(if $(4),$(4) >/dev/null 2>&1 && exit 0;) tmp=$${TMPDIR:-/tmp}; \
	set -- $$(df -Pk $(VENV) "$$tmp" | awk 'NR > 1 {print $$1, int($$4 / 1048576)}'); \
	venv_fs=$$1 free=$$2 tmp_fs=$$3 tmp_free=$$4 need=$(2); [ "$$venv_fs" = "$$tmp_fs" ] && need=$$(($(2) + $(3))); \
	if [ "$$free" -lt "$$need" ] || [ "$$tmp_free" -lt $(3) ]; then \
	  echo "$(1) needs about $(2) GB in $(VENV) and $(3) GB under $$tmp while pip installs it:" >&2; \
	  echo "$$free GB free where $(VENV) is, $$tmp_free GB under $$tmp. Free some space (other checkouts' .venv)," >&2; \
	  echo "or point TMPDIR at a disk with room." >&2; exit 1; fi
endef

.PHONY: setup run lint test bench gpu-check clean

$(BIN)/python:
	$(call need_311,$(PYTHON))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The server, the CLI and the client are tested from the built wheel on Python 3.12 and 3.13 without torch
# (tests/project/test_install.py): one venv each under $(VENV)/pythons/3.X, holding the project's base
# dependencies only. The Pythons are python3.X on PATH, else pyenv's; one that is missing is skipped (the test says so).
OTHER_PYTHONS ?= 3.12 3.13
OTHER_PYTHONS_STAMP := $(VENV)/pythons/.installed
$(OTHER_PYTHONS_STAMP): pyproject.toml | $(BIN)/python
	mkdir -p $(VENV)/pythons
	$(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
	  > $(VENV)/pythons/requirements.txt
	@for v in $(OTHER_PYTHONS); do \
	  py=$$(command -v python$$v 2>/dev/null || true); \
	  if [ -z "$$py" ] || ! "$$py" -c pass 2>/dev/null; then py=$$(pyenv prefix $$v 2>/dev/null)/bin/python; fi; \
	  if ! "$$py" -c pass 2>/dev/null; then echo "Python $$v not found: its install test is skipped" >&2; continue; fi; \
	  echo "$(VENV)/pythons/$$v: $$("$$py" --version)"; \
	  "$$py" -m venv --clear $(VENV)/pythons/$$v && \
	  $(VENV)/pythons/$$v/bin/pip install --quiet --disable-pip-version-check -r $(VENV)/pythons/requirements.txt || exit 1; \
	done
	touch $@

# The worker's tests on the oldest torch the worker extra allows (tests/project/test_torch_floor.py), in a venv of
# its own under $(VENV)/torch-floor: that torch and torchvision (PyPI's CUDA builds, which run on the CPU), then the
# project and its test extra around them. Keep TORCH_FLOOR at the lower bound of the worker extra's torch.
TORCH_FLOOR ?= 2.9.1
TORCHVISION_FLOOR ?= 0.24.1
FLOOR_STAMP := $(VENV)/torch-floor/.installed
$(FLOOR_STAMP): pyproject.toml examples/plugin/pyproject.toml | $(BIN)/python
	$(PYTHON) -m venv --clear $(VENV)/torch-floor
	$(call need_space,The torch floor's venv (torch $(TORCH_FLOOR)'s CUDA build),9,5)
	printf 'torch==%s\ntorchvision==%s\n' $(TORCH_FLOOR) $(TORCHVISION_FLOOR) > $(VENV)/torch-floor/constraints.txt
	$(VENV)/torch-floor/bin/pip install --quiet --disable-pip-version-check -c $(VENV)/torch-floor/constraints.txt \
	  'setuptools>=77' -e '.[test]'
	$(VENV)/torch-floor/bin/pip install --quiet --disable-pip-version-check --no-build-isolation -e examples/plugin
	touch $@

# make run: what running needs, the worker's torch included (the worker extra), and the example plugin (a model,
# a dataset, an entrypoint), which the README's walk-through uses. No test tools, no browser.
$(BIN)/.installed-run: pyproject.toml examples/plugin/pyproject.toml | $(BIN)/python
	$(call need_311,$(BIN)/python,echo "$(VENV) was made with another Python: make clean first." >&2;)
	$(call need_space,The worker's torch,6,4,$(BIN)/python -c 'import torch')
	$(BIN)/pip install --quiet -e '.[worker]'
	$(BIN)/pip install --quiet --no-build-isolation -e examples/plugin
	touch $@

# make test: the test extra on top, the other Pythons the install tests use and the torch floor's venv (above).
$(BIN)/.installed: $(BIN)/.installed-run $(OTHER_PYTHONS_STAMP) $(FLOOR_STAMP)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The browser tests drive Debian's chromium (Playwright's own browser download is not used); the Slurm tests start a
# real cluster of Debian's slurm-wlm and munge (tests/helpers/slurm.py: installing them starts no daemon).
setup: $(BIN)/.installed
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null)

run: $(BIN)/.installed-run
	$(BIN)/trainyard up

# Lint, type and layering checks ([tool.ruff], [tool.mypy], [tool.importlinter] in pyproject.toml); mypy keeps
# so a second run only rechecks what changed.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy --cache-dir $(VENV)/.mypy_cache
	$(BIN)/lint-imports --no-cache

# The suite on PYTEST_WORKERS processes (pytest-xdist), a test file to each at a time (its module-scoped
# services stay in one process): most tests wait on the servers and workers they start, so two processes
# take about half the time on two cores. PYTEST_WORKERS=0 runs it in this process. --durations=30 prints the
# slowest tests at the end: where the suite's time goes (docs/layout.md, "The suite's budget").
PYTEST_WORKERS ?= 2
test: setup lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.train_throughput --rounds 3
	$(BIN)/python -m bench.augment --rounds 3
	$(BIN)/python -m bench.dispatch
	$(BIN)/python -m bench.api
	$(BIN)/python -m bench.run_overhead --rounds 3
	$(BIN)/python -m bench.ddp --rounds 3
	$(BIN)/python -m bench.sweep

# On a CUDA host: the CUDA-marked tests, real jobs on the GPUs through the service, the throughput
# benchmark on cuda:0; one table, with what was skipped and why (`trainyard gpu-check`,
# app/cli/gpu_check.py). No root and no browser: pytest is all it adds (the gpu-check extra).
# Exit status: 0 every check passed, 1 a check failed, 2 nothing could run (no CUDA device).
$(BIN)/.installed-gpu-check: pyproject.toml | $(BIN)/python
	$(call need_311,$(BIN)/python,echo "$(VENV) was made with another Python: make clean first." >&2;)
	$(BIN)/pip install --quiet -e '.[worker,gpu-check]'
	touch $@

gpu-check: $(BIN)/.installed-gpu-check
	$(BIN)/trainyard gpu-check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) trainyard-data .pytest_cache .ruff_cache .mypy_cache
