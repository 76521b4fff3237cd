# The two quick-start commands: `make run` (set up, then server + worker) and `make test`
# (set up, then the whole test suite). Both create ./.venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test bench gpu-check clean

$(BIN)/.installed: pyproject.toml examples/plugin/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	# The example plugin (a model, a dataset, an entrypoint): the plugin tests and the README use it.
	$(BIN)/pip install --quiet --no-build-isolation -e examples/plugin
	touch $@

# The browser tests drive Debian's chromium (Playwright's own browser download is not used).
setup: $(BIN)/.installed
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

run: setup
	$(BIN)/trainyard up

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.train_throughput --rounds 3
	$(BIN)/python -m bench.augment --rounds 3
	$(BIN)/python -m bench.dispatch
	$(BIN)/python -m bench.api
	$(BIN)/python -m bench.run_overhead --rounds 3
	$(BIN)/python -m bench.ddp --rounds 3
	$(BIN)/python -m bench.sweep

# On a CUDA host: the CUDA-marked tests, real jobs on the GPUs through the service, the throughput
# benchmark on cuda:0; one table, with what was skipped and why (bench/gpu_check.py).
gpu-check: setup
	$(BIN)/python -m bench.gpu_check

clean:
	rm -rf $(VENV) trainyard-data .pytest_cache
