"""Triton paged attention: split-KV decode and causal varlen extend/prefill.

Layouts (see `kernels.reference`): q [T|B, H, D]; k_cache, v_cache
[P, S, KVH, D] (v_cache may also be token-major: stride 1 over S); page_table
[B, max_pages] (int32/int64 page ids, entries past a sequence's length are never
read); seq_lens [B] (context length including the new tokens); cu_q_lens [B+1].

Modules: `decode` (paged_decode, the split-KV decode kernel), `splits` (its split count and
the kernel merging the splits), `extend` (paged_extend, extend_tiles, extend_block_m),
`common` (the device helpers and host choices both share).

Softmax runs online in fp32 (exp2 with the scale folded in), outputs are in
q.dtype. `window` (sliding-window attention) and `softcap` (score soft-capping) are
compile-time constants of both kernels, 0 for off: the default variants are the code
without them. So is whether `sinks` (gpt-oss's attention sinks: a float32 logit per query
head, joining the softmax with no value) is given; they are added at the final
normalization (with split-KV decode, once, where the splits are merged). On CPU tensors
(TRITON_INTERPRET=1) operands are upcast to fp32 because the interpreter cannot do bf16
dots, and bf16 roundings are done by hand because it truncates fp32 -> bf16 casts.
"""

from kernels.attention.decode import paged_decode
from kernels.attention.extend import extend_block_m, extend_tiles, paged_extend

__all__ = ["extend_block_m", "extend_tiles", "paged_decode", "paged_extend"]
