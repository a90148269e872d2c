#!/usr/bin/env bash
# The device check for a session that is lent a GPU: the CUDA tests, then both benchmarks on CUDA.
# It runs from the repository root with the machine's own python3 (which has torch with CUDA, Lightning,
# transformers and peft) and no install; everything it measures goes to $OUT (default benchmarks/results/gpu).
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, lightning, transformers; print(torch.__version__, lightning.__version__, transformers.__version__)"; } > "$out/machine.txt" 2>&1
python3 -m pytest -q -p no:cacheprovider tests/test_strategy_cuda.py tests/test_moe_cuda.py > "$out/cuda_tests.txt" 2>&1
python3 benchmarks/bench_streaming.py --device cuda --out "$out" > "$out/bench_streaming.log" 2>&1
python3 benchmarks/bench_moe_paging.py --device cuda --steps 200 --speed-rounds 2 --out "$out" > "$out/bench_moe_paging.log" 2>&1
tail -n 3 "$out/cuda_tests.txt"; cat "$out/streaming_cuda.md" 2>/dev/null; tail -n 20 "$out/bench_moe_paging.log"
