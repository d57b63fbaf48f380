#!/usr/bin/env bash
# One call on the GPU machine: build, run every test, benchmark; short table last.
#   [SKIP_TESTS=1] [SANITIZE=1] [FEATURES=1] [TRACE=1] [FIRST_CALL=1] [DEMO=1] [ACCURACY=1] [TP=1] [HF_EXAMPLE=1] \
#   [SKIP_BENCH=1] [WHEEL=1 (dist/*.whl carried: test it instead of building)] \
#     bash benchmarks/device_run.sh [bench.py arguments]
# TP (two GPUs; the test suite has the NCCL test): the tensor-parallel example and benchmarks/bench_tp.py.
# SANITIZE: compute-sanitizer memcheck and racecheck over CUDA tests, cuBLAS's kernels (nvjet) left out: they
# report hazards of their own. The profiler cannot run there, so the tests that read kernel names skip.
# Peers that the machine lacks travel as wheels in .whl/ (see benchmarks/NOTES.md).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fused_ce_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -n "${WHEEL:-}" ]; then
  # A wheel built elsewhere (on the CPU machine, against this machine's torch; carried in dist/) instead of a
  # build here: the CUDA tests run against it, from outside the source tree.
  python3 -m pip install -q --no-deps --no-index --target /tmp/wheel_site dist/fused_ce-*.whl
  repo=$(pwd)
  (cd /tmp && PYTHONPATH=/tmp/wheel_site python3 -c "import fused_ce; print('wheel:', fused_ce.__file__, fused_ce.cuda_archs())" \
    && PYTHONPATH=/tmp/wheel_site python3 -m pytest -q -p no:cacheprovider -m cuda "$repo/tests" 2>&1 \
    | tee "$OUT/tests_wheel.log" | grep -E "^FAILED|^ERROR|passed|failed")
  exit 0
fi
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | grep -v "WARNING: Running pip" | tail -5
echo "build: $(( $(date +%s) - start )) s"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -rs -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log" | grep -E "^FAILED|^ERROR|^SKIPPED|passed|failed"
fi
if [ -n "${SANITIZE:-}" ]; then
  for tool in memcheck racecheck; do
    FUSED_CE_UNDER_SANITIZER=1 timeout "${SANITIZE_TIMEOUT:-600}" /usr/local/cuda/bin/compute-sanitizer --tool "$tool" --kernel-name-exclude kns=nvjet \
      --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/test_reliability.py tests/test_features.py \
      tests/test_cuda.py -k "cuda and not llama3 and not many_steps and not threads" 2>&1 | tee "$OUT/$tool.log" \
      | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" | sed "s/^/$tool: /"
  done
fi
if [ -n "${ACCURACY:-}" ]; then
  python3 benchmarks/accuracy_vs_n.py 2>&1 | tee "$OUT/accuracy.log" | tail -6
fi
if [ -n "${TP:-}" ]; then
  python3 -m torch.distributed.run --nproc-per-node 2 examples/tp_train.py --steps 20 2>&1 | grep -E "^step|Error"
  python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_tp.py 2>&1 | tee "$OUT/tp.log" | grep -vE "^W[0-9]+|^\*+$"
fi
if [ -n "${HF_EXAMPLE:-}" ]; then  # issue 11: the training example at Llama-3's vocabulary, with the largest batches
  timeout "${HF_EXAMPLE_TIMEOUT:-240}" python3 examples/train_causal_lm.py --device cuda --vocab 128256 --seq 4096 \
    --steps "${HF_EXAMPLE_STEPS:-60}" --find-max-batch --out "$OUT" 2>&1 | tee "$OUT/train_causal_lm.log" | tail -8
fi
if [ -n "${FEATURES:-}" ]; then
  python3 benchmarks/bench_features.py 2>&1 | tee "$OUT/features.log" | tail -16
fi
if [ -n "${TRACE:-}" ]; then
  python3 benchmarks/trace.py --shapes A,B,C 2>&1 | tee "$OUT/trace.log" | grep -E "^==|summary"
fi
if [ -n "${FIRST_CALL:-}" ]; then
  python3 benchmarks/first_call.py 2>&1 | tee "$OUT/first_call.log"
fi
if [ -n "${DEMO:-}" ]; then
  python3 -m fused_ce.demo 2>&1 | tee "$OUT/demo.log" | tail -6
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 benchmarks/bench.py "$@" 2>&1 | tee "$OUT/bench.log" | tail -14
fi
