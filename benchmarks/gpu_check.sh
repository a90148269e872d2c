#!/usr/bin/env bash
# The device check for a session that is lent a GPU, in about 8 minutes at most on one H200, installing nothing.
# It runs from the repository root with the machine's own python3 (torch with CUDA, Lightning, transformers, peft).
# Six independent parts, each under its own `timeout` (one failing or timing out does not stop the others):
#
#   race             delay injection: streamed fits bitwise equal with delays injected on each side   (150 s)
#   launch_blocking  the same fit under CUDA_LAUNCH_BLOCKING=1, bitwise equal                         (60 s)
#   sanitizer        a 2-step fit under TORCH_CUDA_SANITIZER=1                                        (60 s)
#   profiler         engine copies pinned, on side streams, overlapping kernels; GB/s vs a plain copy (60 s)
#   cuda_tests       tests/test_strategy_cuda.py, test_host_arena.py, test_moe_cuda.py, MoE paging under
#                    superpipe on the GPU (test_moe_streaming.py's CUDA test)                         (100 s)
#   benchmark        bench_streaming.py at one setting: step time and peak memory against plain      (75 s)
#
# Results: $OUT (default benchmarks/results/gpu) gets summary.json (per part: passed / failed / timed_out /
# skipped, its figures, and the tail of its log when it did not pass) and logs.tar.gz (every log; kept unpacked in
# $OUT/logs too with GPU_CHECK_KEEP_LOGS=1). Two files, so that all of it comes back from a device run.
#
#   bash benchmarks/gpu_check.sh
#   GPU_CHECK_DEVICE=cpu PYTHON=python bash benchmarks/gpu_check.sh    # smoke run of the script, no GPU needed
#
# Limits can be changed with RACE_S, LAUNCH_BLOCKING_S, SANITIZER_S, PROFILER_S, CUDA_TESTS_S, BENCHMARK_S.
set -uo pipefail
out="${OUT:-benchmarks/results/gpu}"
logs="$out/logs"
device="${GPU_CHECK_DEVICE:-cuda}"
py="${PYTHON:-python3}"
rm -rf "$logs"
mkdir -p "$logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a part killed by its timeout still leaves its log
started=$SECONDS

# part NAME LIMIT COMMAND...: runs COMMAND under `timeout LIMIT`, output to $logs/NAME.log, and records
# "NAME<TAB>exit status<TAB>seconds<TAB>limit" in $logs/parts.tsv (124/137: timed out).
part() {
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "[$(date +%T)] $name (limit $limit s)"
  timeout -k 10 "$limit" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >> "$logs/parts.tsv"
  echo "[$(date +%T)] $name: exit $rc after $((SECONDS - start)) s"
}

# skip NAME WHY: records a part not run on this device (status 3).
skip() {
  echo "$2" > "$logs/$1.log"
  printf '%s\t3\t0\t0\n' "$1" >> "$logs/parts.tsv"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  timeout 60 "$py" -c "import sys, torch, lightning, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
} > "$logs/machine.txt" 2>&1

race="benchmarks/gpu_race_check.py"
part race "${RACE_S:-150}" "$py" "$race" race --device "$device" --json "$logs/race.json" --log-dir "$logs"
part launch_blocking "${LAUNCH_BLOCKING_S:-60}" "$py" "$race" launch-blocking --device "$device" --json "$logs/launch_blocking.json" --log-dir "$logs"
part sanitizer "${SANITIZER_S:-60}" "$py" "$race" sanitizer --device "$device" --json "$logs/sanitizer.json" --log-dir "$logs"
part profiler "${PROFILER_S:-60}" "$py" "$race" profile --device "$device" --json "$logs/profiler.json" --log-dir "$logs"
part cuda_tests "${CUDA_TESTS_S:-100}" "$py" -m pytest -q -p no:cacheprovider tests/test_strategy_cuda.py tests/test_host_arena.py tests/test_moe_cuda.py \
  tests/test_moe_streaming.py::test_on_cuda_the_pages_live_on_the_gpu_and_the_masters_on_the_host --junitxml="$logs/cuda_tests.xml"
if [ "$device" = cuda ]; then
  # One point, not a sweep: the 24-block Llama preset, bf16-mixed, 8192 tokens per micro-batch, resident 1,
  # prefetch 1 against plain; writes streaming_cuda.{md,json} into the logs.
  part benchmark "${BENCHMARK_S:-75}" "$py" benchmarks/bench_streaming.py --device cuda --knobs 1,1 --tokens 8192 --steps 3 --warmup 1 --out "$logs"
else
  skip benchmark "the benchmark runs on CUDA only (the CPU preset takes minutes)"
fi

timeout 60 "$py" benchmarks/gpu_check_summary.py --logs "$logs" --out "$out/summary.json" || echo "the summary failed: see $logs"
tar -czf "$out/logs.tar.gz" -C "$out" logs
[ "${GPU_CHECK_KEEP_LOGS:-0}" = 1 ] || rm -rf "$logs"
echo "gpu_check: $((SECONDS - started)) s; $out/summary.json, $out/logs.tar.gz"
