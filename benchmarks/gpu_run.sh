#!/usr/bin/env bash
# One GPU session: correctness first, then the benchmarks. Usage on the GPU machine:
#   bash benchmarks/gpu_run.sh <part>   (part: check | w1w2 | w3w4 | all)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() { python3 -m streamer bench offline "$@" 2>&1 | grep -v "\] [0-9]*/[0-9]* "; }
part=${1:-check}
if [ "$part" = check ] || [ "$part" = all ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu ${KERNEL_TESTS:-} -m cuda 2>&1 | tail -6
fi
if [ "$part" = w1w2 ] || [ "$part" = all ]; then
  bench --workload W2 --max-num-seqs 8 --json "$OUT/w2.json"
  bench --workload W1 --json "$OUT/w1.json"
fi
if [ "$part" = w3w4 ] || [ "$part" = all ]; then
  bench --workload W3 --num-requests "${W3_N:-256}" --json "$OUT/w3.json"
  bench --workload W4 --num-requests "${W4_GROUPS:-8}" --no-peer --json "$OUT/w4.json"
fi
