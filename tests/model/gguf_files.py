"""Tiny GGUF files written in the tests, as llama.cpp's convert_hf_to_gguf.py writes them.

A random-weight HF folder (conftest.make_tiny_model) becomes a GGUF with gguf's own
GGUFWriter: llama.cpp's tensor names (gguf's name map), q/k rows permuted for llama (as
llama.cpp does and transformers undoes), and the tokenizer as metadata (a "gpt2" BPE: tokens,
types, merges, special ids, the chat template) so that transformers can rebuild it.

The tokenizer is SmolLM2's cut to its first VOCAB tokens (the specials, the 256 bytes, the
first merges): every text still tokenizes, and rebuilding it from the file takes
milliseconds, not the seconds 49,152 tokens take.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 1024
ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(writer, tokenizer_src: Path) -> None:
    tj = json.loads((tokenizer_src / "tokenizer.json").read_text())
    ids = tj["model"]["vocab"]
    tokens = sorted((i, t) for t, i in ids.items() if i < VOCAB)
    kept = {t for _, t in tokens}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    merges = [m for m in merges if m.replace(" ", "") in kept and all(p in kept for p in m.split(" "))]
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([t for _, t in tokens])
    writer.add_token_types([3 if i in special else 1 for i, _ in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template((tokenizer_src / "chat_template.jinja").read_text())


def write_gguf(folder: Path, out: Path, tokenizer_src: Path, tensor_type: str = "F32") -> Path:
    """folder (a tiny HF model) as a GGUF file at out, its matrices of tensor_type (F32, F16,
    F64, or Q8_0 through gguf's quantizer); 1-D tensors stay F32, as llama.cpp keeps them."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    arch = ARCHS[cfg.architectures[0]]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    tokenizer_metadata(w, tokenizer_src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, a in load_file(str(folder / "model.safetensors")).items():
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            a = _permute(a, cfg.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            a = _permute(a, cfg.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if a.ndim == 1 or tensor_type == "F32":
            w.add_tensor(name, a)
        elif tensor_type in ("F16", "F64"):
            w.add_tensor(name, a.astype({"F16": np.float16, "F64": np.float64}[tensor_type]))
        else:
            qtype = gguf.GGMLQuantizationType[tensor_type]
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_header_only(out: Path, arch: str, **metadata: str) -> Path:
    """A GGUF with an architecture, string metadata and no tensors: enough for the checks
    that come before any weight is read."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    for key, value in metadata.items():
        w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
