#!/usr/bin/env bash
# The GPU checks in one run: the CUDA test suite (bf16/fp16, sdpa, no host syncs while decoding,
# the static layout: same kept set, decode step captured in CUDA graphs; teacher statistics
# against float64) and the serving benchmark (eval/bench_serving.py: the largest batch that
# really runs under an 80 GiB cap and its measured tokens/s, DynamicCache / compiled StaticCache
# / budget 0.3 / 0.3+INT8 on the static layout, compiled) on the Llama-3.1-8B shape. Opt-in
# steps, measured on 2026-11-29 (docs/gpu-h200.md): the teacher statistics at 8K/16K/32K and
# bench_gpu (bf16, fp16). Logs and JSON rows go to $OUT (default results/gpu).
#
# Sized for a 15-minute device budget: pytest ~1-2 min (limit 240 s; 45 s with PYTEST_ARGS="-n 8"
# on the H200, 2026-11-30), serving at 32K only by default (limit 480 s; rows are written as they
# complete, the headline pair first; 32K, 16K and 8K together took 483 s on 2026-11-30:
# STEPS=serving SERVING_LIMIT=530 SERVING_LENGTHS=32768,16384,8192, docs/serving.md).
#
#   bash eval/gpu_checks.sh                                  # on a CUDA machine
#   OUT=/tmp/gpu DEVICE=cpu SHAPE=tiny LENGTHS=256,512 DTYPE=float32 SERVING_LENGTHS=256 \
#     SERVING_ARGS=--tiny bash eval/gpu_checks.sh                                 # plumbing, on a CPU
#
#   STEPS=serving SERVING_ARGS="--probes 2" bash eval/gpu_checks.sh   # the benchmark alone, quicker
#
# Each step has its own time limit, so one slow step cannot starve the others. STEPS picks steps
# (default: pytest int8step serving; also teacher bench fp16; int8step is eval/bench_int8_step.py,
# what one INT8 decode step allocates, limit 90 s; stepops is eval/bench_step_ops.py, the ops,
# allocations and time of the cache's work between decode steps, limit 120 s, STEPOPS_ARGS);
# PYTEST_K selects tests (-k), PYTEST_ARGS
# adds flags (-s); SERVING_LENGTHS, SERVING_ARGS (e.g. --probes, --new-tokens, --memory-gib).
# SERVING_RESUME=FILE: the bench_serving.json of an earlier run cut short (e.g. a device call's
# time limit) is copied to $OUT and only its missing or failed rows are measured (--resume;
# it stops if the file's rows were measured under other flags or on another machine).
set -u -o pipefail
OUT=${OUT:-results/gpu}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-llama-3.1-8b}
LENGTHS=${LENGTHS:-8192,16384,32768}
DTYPE=${DTYPE:-bfloat16}
PY=${PYTHON:-python3}
STEPS=${STEPS:-pytest int8step serving}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

{
  date -u +"%Y-%m-%d %H:%M UTC"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
} 2>&1 | tee "$OUT/env.txt"

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
}

want() { [[ " $STEPS " == *" $1 "* ]]; }
want pytest && step pytest_cuda "${PYTEST_LIMIT:-240}" env SPARSEKV_TEST_DEVICE="$DEVICE" \
  $PY -m pytest tests/test_cuda.py -q -p no:cacheprovider -rs --durations=5 ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-}
want int8step && step int8_step "${INT8_LIMIT:-90}" $PY eval/bench_int8_step.py --shape "$SHAPE" \
  --device "$DEVICE" --dtype "$DTYPE" --batch "${INT8_BATCH:-8}" --json "$OUT/int8_step.json"
want stepops && step step_ops "${STEPOPS_LIMIT:-120}" $PY eval/bench_step_ops.py --device "$DEVICE" \
  --dtype "$DTYPE" ${STEPOPS_ARGS:---width full --batch 8 --prompt 8192} --json "$OUT/step_ops.json"
if want serving && [ -n "${SERVING_RESUME:-}" ]; then
  cp "$SERVING_RESUME" "$OUT/bench_serving.json" || { echo "SERVING_RESUME=$SERVING_RESUME: no such file"; exit 2; }
  SERVING_ARGS="${SERVING_ARGS:-} --resume"
fi
want serving && step bench_serving "${SERVING_LIMIT:-480}" $PY eval/bench_serving.py --shape "$SHAPE" \
  --device "$DEVICE" --dtype "$DTYPE" --lengths "${SERVING_LENGTHS:-32768}" ${SERVING_ARGS:-} \
  --json "$OUT/bench_serving.json"
want teacher && step teacher "${TEACHER_LIMIT:-150}" $PY eval/bench_teacher.py --shape "$SHAPE" \
  --device "$DEVICE" --dtype "$DTYPE" --lengths "$LENGTHS" --json "$OUT/teacher.json"
want bench && step bench_gpu "${BENCH_LIMIT:-300}" $PY eval/bench_gpu.py --shape "$SHAPE" --device "$DEVICE" \
  --dtype "$DTYPE" --lengths "$LENGTHS" --profile 4 ${BENCH_ARGS:-} --json "$OUT/bench_gpu.json"
want fp16 && step bench_gpu_fp16 "${FP16_LIMIT:-120}" $PY eval/bench_gpu.py --shape "$SHAPE" \
  --device "$DEVICE" --dtype float16 --lengths "${LENGTHS%%,*}" --modes dynamic,0.3,0.3+int8
exit $status
