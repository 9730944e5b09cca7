"""How many KV pages the engine gets: the PagePool sized from the memory the weights leave."""

from __future__ import annotations

from typing import Any

import torch

from streamer.config import EngineConfig
from streamer.errors import ConfigError
from streamer.kv.pages import PagePool
from streamer.model.draft import DraftModel
from streamer.model.tp_group import current as tensor_parallel


def make_pool(model: Any, cfg: Any, c: EngineConfig, device: torch.device, kv_dtype: torch.dtype,
              draft: DraftModel | None) -> PagePool:
    """The engine's KV pool: config.num_pages pages, or as many as the memory left after the
    weights allows (gpu_memory_fraction of the card, less 1 GiB of headroom; cpu_kv_bytes on
    CPU); a page id holds the target's KV of its tokens and the draft's (draft: a speculative
    draft model or EAGLE head); under tensor parallelism this rank's KV heads, and the fewest
    pages any rank can hold."""
    layers, kvh, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, model.head_dim
    shared_v = 0
    latent = getattr(model, "latent_cache", None)
    if latent is not None:  # MLA (model/deepseek.py): one latent "head" per token, V its first dims
        kvh, (hd, shared_v) = 1, latent
    tp = tensor_parallel()
    if tp is not None:  # this rank's KV heads
        kvh = tp.heads(cfg.num_attention_heads, kvh)[1]
    per_page = PagePool.bytes_per_page(layers, c.page_size, kvh, hd, kv_dtype, shared_v)
    if draft is not None:  # a page id holds the target's and the draft's KV of its tokens
        per_page += draft.bytes_per_page(c.page_size)
    if c.num_pages is not None:
        n = c.num_pages
    elif device.type == "cuda":
        torch.cuda.synchronize()
        # blocks cached by the allocator count as used in mem_get_info: an engine released
        # earlier in the process (whose last references went after its release) left some
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * c.gpu_memory_fraction) - (total - free) - (1 << 30)
        n = budget // per_page
    else:
        n = c.cpu_kv_bytes // per_page
    if tp is not None:  # the scheduler's pages must exist on every rank
        n = tp.min_int(n)
    if n < 2:
        raise ConfigError(f"not enough memory for the KV pool ({n} pages of {per_page} bytes)")
    return PagePool(layers, n, c.page_size, kvh, hd, kv_dtype, device, shared_v)
