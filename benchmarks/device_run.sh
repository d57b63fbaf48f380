#!/usr/bin/env bash
# On a GPU host: build, run every test, benchmark; short table last.
#   [SKIP_BUILD=1] [SKIP_TESTS=1] [ALONGSIDE=command] [SANITIZE=1|memcheck|racecheck] [FEATURES=1] [TUNE_GEMM=1] [TRACE=1] [FIRST_CALL=1] [DEMO=1] [ACCURACY=1] [TP=1] [HF_EXAMPLE=1] \
#   [SKIP_BENCH=1] [WHEEL=1 (dist/*.whl present: test it instead of building)] \
#   [WHEELS=1 (.wheels/before/*.whl and .wheels/after/*.whl present, built on a CPU-only machine against this torch: the CUDA
#    tests on "after", then each line of $RUNS, "label|before or after (or sets joined by +)|script and arguments",
#    timed (TESTS: pytest's arguments, TESTS_K its -k, by default the GPU's tests, 8 at a time); other sets of wheels in .wheels/NAME/ go to their own site, NAME in $RUNS)] \
#     bash benchmarks/device_run.sh [--out DIR] [bench.py arguments]
# Logs and the results' archive go to DIR (by default benchmarks/results/device_run/).
# TP (two GPUs; the test suite has the NCCL test): the tensor-parallel example and benchmarks/bench_tp.py.
# SANITIZE: compute-sanitizer memcheck and racecheck over CUDA tests (cuBLAS's kernels report hazards of their
# own: see sanitize()). The profiler cannot run there, so the tests that read kernel names skip.
# Peers the host lacks are installed from wheels in .whl/ (see benchmarks/NOTES.md).
set -uo pipefail
export PYTHONUNBUFFERED=1
out_dir=benchmarks/results/device_run
if [ "${1:-}" = "--out" ]; then
  out_dir=$2
  shift 2
fi
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)  # (the runs below change directory)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -n "${WHEEL:-}" ]; then
  # A wheel built on a CPU-only build machine (against this host's torch; in dist/) instead of a
  # build here: the CUDA tests run against it, from outside the source tree.
  python3 -m pip install -q --no-deps --no-index --target /tmp/wheel_site dist/fused_ce-*.whl
  repo=$(pwd)
  (cd /tmp && PYTHONPATH=/tmp/wheel_site python3 -c "import fused_ce; print('wheel:', fused_ce.__file__, fused_ce.cuda_archs())" \
    && PYTHONPATH=/tmp/wheel_site python3 -m pytest -q -p no:cacheprovider -m cuda "$repo/tests" 2>&1 \
    | tee "$out_dir/tests_wheel.log" | grep -E "^FAILED|^ERROR|passed|failed")
  exit 0
fi
if [ -n "${WHEELS:-}" ]; then
  # Two wheels built on a CPU-only build machine against this host's torch (no build here): the tests run on "after"
  # from outside the source tree, then each run of $RUNS with the wheel it names.
  for dir in .wheels/*/; do  # before, after, and any other set (a peer's other version) in its own site
    which=$(basename "$dir")
    ls "$dir"*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site_$which "$dir"*.whl
  done
  repo=$(pwd)
  start=$(date +%s)
  if [ -z "${SKIP_TESTS:-}" ]; then
    # (by default every test that runs on the GPU: `-m cuda` alone misses those parametrized on the device)
    (cd /tmp && PYTHONPATH=/tmp/site_after:${PYTHONPATH:-} timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider \
      ${TESTS:--n 8 $repo/tests} -k "${TESTS_K:-cuda or kept or tiles or distill_rows}" 2>&1 | tee "$out_dir/tests_after.log" \
      | grep -E "^FAILED|^ERROR|passed|failed" | tail -15)
    echo "tests: $(( $(date +%s) - start )) s"
  fi
  IFS=';' read -ra runs <<< "${RUNS:-}"
  for run in "${runs[@]}"; do
    IFS='|' read -r label which command <<< "$run"
    [ -n "$label" ] || continue
    sites=$(echo "$which" | sed 's|\([^+]*\)|/tmp/site_\1|g; s|+|:|g')  # "trl114+after": both, the first first
    echo "== $label ($which): $command"
    mkdir -p /tmp/results/$label
    (cd benchmarks && PYTHONPATH=$sites:${PYTHONPATH:-} timeout "${RUN_TIMEOUT:-240}" python3 $command --out /tmp/results/$label 2>&1 \
      | tee /tmp/results/$label/run.log | grep -E "^\| |^fused_ce|batch +[0-9]+: |first call|out of memory|Error" | tail -"${RUN_TAIL:-12}")
  done
  # (every run's results in one archive beside the logs)
  tar czf "$out_dir/results.tgz" -C /tmp/results . 2>/dev/null
  echo "total: $(( $(date +%s) - start )) s"
  exit 0
fi
start=$(date +%s)
[ -n "${SKIP_BUILD:-}" ] || python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | grep -v "WARNING: Running pip" | tail -5
echo "build: $(( $(date +%s) - start )) s"
if [ -n "${ALONGSIDE:-}" ]; then  # a diagnosis command run next to the tests, on the second GPU
  CUDA_VISIBLE_DEVICES=1 bash -c "$ALONGSIDE" >"$out_dir/alongside.log" 2>&1 &
  alongside=$!
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    # The suite in three groups at once (one per GPU, the multi-GPU tests on both): ~7 minutes run serially.
    gpu0="tests/test_cuda.py tests/test_autograd_and_dtypes.py tests/test_edges_and_errors.py tests/test_cuda_graphs.py tests/test_kernels.py tests/test_loss_matches_torch.py"
    ignore=$(for f in $gpu0 tests/test_distributed.py; do printf -- "--ignore=%s " "$f"; done)
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -rsxX -p no:cacheprovider $gpu0 >"$out_dir/tests_gpu0.log" 2>&1 &
    groups="$!"
    CUDA_VISIBLE_DEVICES=1 python3 -m pytest -q -rsxX -p no:cacheprovider $ignore tests >"$out_dir/tests_gpu1.log" 2>&1 &
    groups="$groups $!"
    python3 -m pytest -q -rsxX -p no:cacheprovider tests/test_distributed.py >"$out_dir/tests_multi_gpu.log" 2>&1 &
    wait $groups $!
    for log in "$out_dir"/tests_gpu0.log "$out_dir"/tests_gpu1.log "$out_dir"/tests_multi_gpu.log; do
      grep -E "^FAILED|^ERROR|^SKIPPED|^XFAIL|^XPASS|passed|failed" "$log" | sed "s|^|$(basename "$log" .log): |"
    done
  else
    python3 -m pytest -q -rs -p no:cacheprovider tests 2>&1 | tee "$out_dir/tests.log" | grep -E "^FAILED|^ERROR|^SKIPPED|passed|failed"
  fi
  echo "tests: $(( $(date +%s) - start )) s"
fi
if [ -n "${ALONGSIDE:-}" ]; then
  wait "$alongside"
  echo "== alongside: $ALONGSIDE"
  tail -c "${ALONGSIDE_TAIL:-6000}" "$out_dir/alongside.log"
fi
sanitizer=/usr/local/cuda/bin/compute-sanitizer
# memcheck leaves cuBLAS's nvjet kernels out. racecheck checks every kernel (with cuBLAS's left out it failed
# once with "failed to handle a hardware exception") and lists every hazard; cuBLAS's own (nvjet, xmma, gemm,
# cutlass) are counted apart, any other kernel's hazard is ours to fix.
sanitize() {  # tool, GPU
  local filter="--kernel-name-exclude kns=nvjet --print-limit 20"
  [ "$1" = racecheck ] && filter="--print-limit 1000000"
  CUDA_VISIBLE_DEVICES=$2 FUSED_CE_UNDER_SANITIZER=1 timeout "${SANITIZE_TIMEOUT:-600}" $sanitizer --tool "$1" $filter \
    python3 -m pytest -q -p no:cacheprovider tests/test_edges_and_errors.py tests/test_autograd_and_dtypes.py tests/test_cuda.py \
    -k "cuda and not llama3 and not many_steps and not threads" >"$out_dir/$1.log" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Internal Sanitizer|passed|failed" "$out_dir/$1.log" | sed "s/^/$1: /"
  if [ "$1" = racecheck ]; then
    grep -oE "(Read|Write) access at [A-Za-z0-9_]+" "$out_dir/$1.log" | awk '{print $4}' | sort | uniq -c \
      | sed "s/^/racecheck: hazards in /"
    echo "racecheck: hazard reports outside cuBLAS's kernels: $(grep -E "(Read|Write) access at" "$out_dir/$1.log" \
      | grep -cvE "nvjet|xmma|gemm|cutlass")"
  fi
}
if [ -n "${SANITIZE:-}" ]; then
  if [ "${SANITIZE}" != 1 ]; then  # SANITIZE=racecheck (or memcheck): that tool only
    sanitize "$SANITIZE" "${CUDA_VISIBLE_DEVICES:-0}"
  elif [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # both tools at once, one per GPU
    sanitize memcheck 0 &
    sanitize racecheck 1
    wait
  else
    sanitize memcheck 0
    sanitize racecheck 0
  fi
fi
if [ -n "${ACCURACY:-}" ]; then
  python3 benchmarks/accuracy_vs_n.py 2>&1 | tee "$out_dir/accuracy.log" | tail -6
fi
if [ -n "${TP:-}" ]; then
  python3 -m torch.distributed.run --nproc-per-node 2 examples/tp_train.py --steps 20 2>&1 | grep -E "^step|Error"
  python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_tp.py 2>&1 | tee "$out_dir/tp.log" | grep -vE "^W[0-9]+|^\*+$"
fi
if [ -n "${HF_EXAMPLE:-}" ]; then  # issue 11: the training example at Llama-3's vocabulary, with the largest batches
  timeout "${HF_EXAMPLE_TIMEOUT:-240}" python3 examples/train_causal_lm.py --device cuda --vocab 128256 --seq 4096 \
    --steps "${HF_EXAMPLE_STEPS:-60}" --find-max-batch --out "$out_dir" 2>&1 | tee "$out_dir/train_causal_lm.log" | tail -8
fi
if [ -n "${TUNE_GEMM:-}" ]; then  # issue 13: gemm.py's persistent TMA GEMM against torch at A, B, C
  python3 benchmarks/tune.py --parts gemm --repeat 10 2>&1 | tee "$out_dir/tune_gemm.log" | grep -vE "^\s*$" | tail -90
fi
if [ -n "${FEATURES:-}" ]; then
  python3 benchmarks/bench_features.py 2>&1 | tee "$out_dir/features.log" | tail -16
fi
if [ -n "${TRACE:-}" ]; then
  python3 benchmarks/trace.py --shapes A,B,C 2>&1 | tee "$out_dir/trace.log" | grep -E "^==|summary"
fi
if [ -n "${FIRST_CALL:-}" ]; then
  python3 benchmarks/first_call.py 2>&1 | tee "$out_dir/first_call.log"
fi
if [ -n "${DEMO:-}" ]; then
  python3 -m fused_ce.demo 2>&1 | tee "$out_dir/demo.log" | tail -6
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 benchmarks/bench.py "$@" 2>&1 | tee "$out_dir/bench.log" | tail -14
fi
