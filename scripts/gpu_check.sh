#!/usr/bin/env bash
# On a machine with a CUDA GPU (the project's lent H200): the CUDA tests, then the GPU
# benchmark, in one command, their output written under $OUT (default ./gpu-out).
#
#     bash scripts/gpu_check.sh            # ~8 min on an H200: tests ~1 min, bench ~7 min
#     REQUESTS=32 bash scripts/gpu_check.sh  # a shorter bench
#     SHAPES=llama-3.2-1b bash scripts/gpu_check.sh  # one shape (of minserve/bench/gpu.py's)
#
# Needs torch with CUDA and transformers >= 5 on that machine; minserve is imported from
# this checkout (no install). nbval is not needed there: the repository's pytest options
# (which name it) are replaced on the command line.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Nothing is downloaded (random weights): with the hub offline a library that would look
# for something there (HF continuous batching looks for flash-attention kernels) fails at
# once instead of waiting on a network the lent machine does not have.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 - <<'PY' 2>&1 | tee "$out/device.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))
PY
# a hang in the tests must not take the benchmark's minutes: at most 5 of them
timeout 300 python3 -m pytest -q -o addopts="" -p no:cacheprovider -m cuda tests/test_cuda.py 2>&1 \
    | tee "$out/cuda_tests.log"
python3 -m minserve.bench gpu --device cuda --out "$out" ${REQUESTS:+--requests $REQUESTS} \
    ${SHAPES:+--shapes $SHAPES} 2>&1 \
    | tee "$out/gpu_bench.log"
