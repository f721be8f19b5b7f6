#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--dry-run] [--out DIR]
#
# The day a GPU is lent (issue 32): the whole cuda test tier (pytest -m cuda tests/cuda) and
# scripts/bench_gpu.py in one command, then one table: parity, the findings, memory and step
# time against FSDP2 (scripts/gpu_report.py). Made for one H100 with no network, the project run
# from this checkout on PYTHONPATH (GUIDE.md section 6); about 10 minutes at most, each part
# under its own time limit. --dry-run lists what it would run and runs nothing (any machine).
# Exit status: non-zero when a test failed or a benchmark system failed.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=""
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --out) shift; out="${1:-}" ;;
    -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run or --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
python="${PYTHON:-$(command -v python || command -v python3)}"
if [ -z "$out" ]; then
  if [ "$dry_run" = 1 ]; then out="<a new temporary directory>"; else out="$(mktemp -d -t zerorun-gpu-check-XXXXXX)"; fi
fi

# Each step: a time limit in seconds, then the command. 330 + 240 s leave room in 10 minutes.
steps=(
  "330|$python -m pytest -m cuda tests/cuda -q -rs -p no:cacheprovider --junitxml=$out/cuda.xml"
  "240|$python scripts/bench_gpu.py --steps 10 --warmup 3 --json $out/bench.json"
  "30|$python scripts/gpu_report.py $out"
)

if [ "$dry_run" = 1 ]; then
  echo "gpu_check.sh would run, in $repo with PYTHONPATH=$repo (results under $out):"
  for step in "${steps[@]}"; do
    echo "  [limit ${step%%|*} s] ${step#*|}"
  done
  exit 0
fi

cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export ZERORUN_GPU_CHECK_OUT="$out"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_check.sh: no CUDA device here (torch.cuda.is_available() is False); --dry-run lists the steps" >&2; exit 2; }
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
