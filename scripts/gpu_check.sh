#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--dry-run | --list] [--out DIR]
#
# The day a GPU is lent (issues 32, 41): the cuda test tier (pytest -m cuda tests/cuda) and
# scripts/bench_gpu.py (Hugging Face Llama 1.26B, bf16, FSDP2 / DDP / zerorun / DeepSpeed) in one
# command, then one Markdown table (scripts/gpu_report.py). Needs no package index: it runs the
# Python that has torch ($PYTHON, else this checkout's .venv, else python3), with this checkout on
# PYTHONPATH. Within 8 minutes on one H200, each part under its own time limit.
# --dry-run: the same steps on the CPU (the tier all skipped, the benchmark on a tiny Llama).
# --list: print the steps and run nothing. Exit status: non-zero when a test or a system failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=""
mode=gpu
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) mode=dry ;;
    --list) mode=list ;;
    --out) shift; out="${1:-}" ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --list or --out DIR)" >&2; exit 2 ;;
  esac
  shift
done

has_torch() { [ -n "$1" ] && "$1" -c "import torch" >/dev/null 2>&1; }
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in "$repo/.venv/bin/python" "$(command -v python3 || true)" "$(command -v python || true)"; do
    if has_torch "$candidate"; then python="$candidate"; break; fi
  done
fi
if [ "$mode" != list ] && ! has_torch "$python"; then
  echo "gpu_check.sh: no Python with torch found (set PYTHON=/path/to/python)" >&2
  exit 2
fi
python="${python:-python3}"
if [ -z "$out" ]; then
  if [ "$mode" = list ]; then out="<a new temporary directory>"; else out="$(mktemp -d -t zerorun-gpu-check-XXXXXX)"; fi
fi
bench_args="--json $out/bench.json"
[ "$mode" = dry ] && bench_args="--dry-run $bench_args"

# Each step: a time limit in seconds, then the command; 250 + 210 + 20 s = 8 minutes on the GPU.
# A dry run's CPU may be shared and slow: its limits only stop a hang.
tier_limit=250 bench_limit=210
[ "$mode" = dry ] && tier_limit=600 bench_limit=600
steps=(
  "$tier_limit|$python -m pytest -m cuda tests/cuda -q -rs -p no:cacheprovider --junitxml=$out/cuda.xml"
  "$bench_limit|$python scripts/bench_gpu.py $bench_args"
  "20|$python scripts/gpu_report.py $out"
)

if [ "$mode" = list ]; then
  echo "gpu_check.sh would run, in $repo with PYTHONPATH=$repo (results under $out):"
  for step in "${steps[@]}"; do
    echo "  [limit ${step%%|*} s] ${step#*|}"
  done
  exit 0
fi

cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export ZERORUN_GPU_CHECK_OUT="$out"
if [ "$mode" = gpu ]; then
  "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check.sh: no CUDA device here (torch.cuda.is_available() is False); --dry-run runs the same steps on the CPU" >&2; exit 2; }
fi
status=0
for step in "${steps[@]}"; do
  limit="${step%%|*}"
  command="${step#*|}"
  echo "== $command"
  timeout --kill-after=10 "$limit" $command
  rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "gpu_check.sh: over its ${limit} s limit: $command" >&2
    status=1
  fi
done
echo "results: $out"
exit $status
