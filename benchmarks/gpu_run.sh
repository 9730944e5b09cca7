#!/usr/bin/env bash
# One GPU session: correctness first, then the benchmarks. Usage on the GPU machine:
#   bash benchmarks/gpu_run.sh <part>   (part: check | w1w2 | w3w4)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-check}" in
  check)
    python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels -m cuda 2>&1 | tail -15
    ;;
  w1w2)
    [ -n "${WITH_CHECK:-}" ] && python3 -m pytest -q -p no:cacheprovider tests/gpu -m cuda 2>&1 | tail -8
    python3 -m streamer bench offline --workload W2 --max-num-seqs 8 --json "$OUT/w2.json" 2>&1 | grep -v "^W2 \["
    python3 -m streamer bench offline --workload W1 --json "$OUT/w1.json" 2>&1 | grep -v "^W1 \["
    ;;
  w3w4)
    python3 -m pytest -q -p no:cacheprovider tests/gpu -m cuda 2>&1 | tail -8
    python3 -m streamer bench offline --workload W3 --num-requests "${W3_N:-256}" --json "$OUT/w3.json" 2>&1 | grep -v "^W3 \["
    python3 -m streamer bench offline --workload W4 --num-requests "${W4_GROUPS:-8}" --no-peer --json "$OUT/w4.json" 2>&1 | grep -v "^W4 \["
    ;;
esac
