#!/usr/bin/env bash
# The kvpress peer run: kvpress's presses on the prompts of a sparsekv evaluation, rows in the
# harness's format, added to the evaluation's tables and plots. See README.md beside this file.
#
#   bash eval/peers/kvpress/run.sh --results results/x [--budget 0.1,0.3] [run_presses.py flags]
#   bash eval/peers/kvpress/run.sh --prompts results/x/prompts.jsonl --budget 0.3 --out rows.jsonl
#   bash eval/peers/kvpress/run.sh --setup-only
#   bash eval/peers/kvpress/run.sh --gate        # the gate alone on the committed subset (~40 min)
#
# --results DIR   an evaluation folder (from `sparsekv eval`, or `sparsekv eval --dump-prompts`):
#                 reads DIR/prompts.jsonl and DIR/config.yaml (budgets, model), writes
#                 DIR/kvpress.jsonl, then adds the rows to DIR's results, summary and plots
#                 (with the main environment's python; --no-ingest to skip).
# Other flags go to run_presses.py (--presses, --layers, --protocol, --tasks, --samples,
# --threads, --resume, --dry-run, ...; `run.sh --help` lists them).
#
# Environment: KVPRESS_VENV (default: .venv beside this file), SPARSEKV_PYTHON (the python
# with sparsekv installed; default: python3), KVPRESS_TORCH (default: torch==2.13.0, installed
# before kvpress so that pip keeps it), PYTHON (the interpreter that creates the venv).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${KVPRESS_VENV:-$HERE/.venv}"
MAIN_PY="${SPARSEKV_PYTHON:-python3}"
TORCH_SPEC="${KVPRESS_TORCH:-torch==2.13.0}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

results="" ; prompts="" ; out="" ; model="" ; config="" ; setup_only=0 ; ingest=1 ; help=0
gate_only=0 ; gate_args=""
pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --results) results="$2"; shift 2 ;;
    --prompts) prompts="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --setup-only) setup_only=1; shift ;;
    --gate) gate_only=1; shift ;;
    --gate-min) gate_args="--min-prompts $2"; shift 2 ;;
    --no-ingest) ingest=0; shift ;;
    -h|--help) help=1; shift ;;
    *) pass+=("$1"); shift ;;
  esac
done

setup_venv() {
  local stamp="$VENV/.sparsekv-peer-stamp"
  local want
  want="$(cat "$HERE/requirements.txt"; echo "$TORCH_SPEC")"
  if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  echo "[kvpress peer] creating $VENV ($TORCH_SPEC, then $(grep -v '^#' "$HERE/requirements.txt" | xargs))" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" >&2
  "$VENV/bin/python" -m pip install -q -r "$HERE/requirements.txt" >&2
  "$VENV/bin/python" -c "import kvpress, transformers, torch; print('[kvpress peer] kvpress', \
__import__('importlib.metadata').metadata.version('kvpress'), '| transformers', transformers.__version__, \
'| torch', torch.__version__)" >&2
  echo "$want" > "$stamp"
}

setup_venv
[ "$setup_only" = 1 ] && exit 0
if [ "$help" = 1 ]; then
  exec "$VENV/bin/python" "$HERE/run_presses.py" --help
fi

if [ "$gate_only" = 1 ]; then
  # The fixed gate subset: 20 committed learned-4k prompts (5 each of passkey, multikey,
  # multivalue, vartrack) x both protocols, against sparsekv's committed full-cache rows.
  tmp="$(mktemp -d)"
  gzip -dc "$HERE/gate-prompts.jsonl.gz" > "$tmp/prompts.jsonl"
  prompts="$tmp/prompts.jsonl"
  out="${out:-$HERE/gate-kvpress.jsonl}"
  pass+=(--reference-only --protocol agnostic,aware --resume)
fi
if [ -n "$results" ]; then
  [ -f "$results/prompts.jsonl" ] || { echo "run.sh: $results/prompts.jsonl not found: run sparsekv eval (or --dump-prompts) with --out $results first" >&2; exit 2; }
  prompts="${prompts:-$results/prompts.jsonl}"
  out="${out:-$results/kvpress.jsonl}"
  if [ -z "$config" ] && [ -f "$results/config.yaml" ]; then config="$results/config.yaml"; fi
fi
[ -n "$prompts" ] || { echo "run.sh: give --results DIR or --prompts FILE (see the top of this file)" >&2; exit 2; }
[ -n "$out" ] || out="$(dirname "$prompts")/kvpress.jsonl"

# The model: --model, else the config's model when it is a folder, else the default model's
# converted folder (created by the main environment on first use).
if [ -z "$model" ] && [ -n "$config" ]; then
  cfg_model="$("$VENV/bin/python" -c "import sys, yaml; print((yaml.safe_load(open(sys.argv[1])) or {}).get('model') or 'default')" "$config")"
  if [ "$cfg_model" != "default" ]; then model="$cfg_model"; fi
fi
if [ -z "$model" ]; then
  model="$("$MAIN_PY" -c "import sparsekv; print(sparsekv.default_model_path())")" || {
    echo "run.sh: cannot ask $MAIN_PY for the default model's folder; set SPARSEKV_PYTHON or pass --model DIR" >&2; exit 2; }
  if [ ! -f "$model/config.json" ]; then
    echo "[kvpress peer] converting the default model into $model (first use)" >&2
    "$MAIN_PY" -c "import sparsekv; sparsekv.load_default_model()" >&2
  fi
fi

args=(--prompts "$prompts" --out "$out" --model "$model")
[ -n "$config" ] && args+=(--config "$config")
"$VENV/bin/python" "$HERE/run_presses.py" "${args[@]}" ${pass[@]+"${pass[@]}"}
if [ "$gate_only" = 1 ]; then
  exec "$MAIN_PY" "$HERE/kvp_gate.py" --peer "$out" --reference "$HERE/gate-reference.jsonl.gz" \
    --out "${out%.jsonl}-gate.json" $gate_args
fi

if [ -n "$results" ] && [ "$ingest" = 1 ]; then
  for a in ${pass[@]+"${pass[@]}"}; do [ "$a" = "--dry-run" ] && exit 0; done
  # The gate: kvpress's own no-press run must reproduce sparsekv's full cache on these prompts
  # (same tokens on >= 95% of at least 40 prompts); otherwise its rows stay out of the tables.
  if ! "$MAIN_PY" "$HERE/kvp_gate.py" --peer "$out" --reference "$results/results.jsonl" \
      --out "$results/kvpress-gate.json" $gate_args; then
    echo "[kvpress peer] gate failed: rows kept in $out but not added to $results (see $results/kvpress-gate.json)" >&2
    exit 1
  fi
  "$MAIN_PY" -c "
import sys
from sparsekv.evaluation import ingest_rows
n = ingest_rows(sys.argv[1], sys.argv[2], source='kvpress')
print(f'[kvpress peer] added {n} rows to {sys.argv[1]}/results.jsonl; summary.md, summary.csv and plots rewritten', file=sys.stderr)
" "$results" "$out"
fi
