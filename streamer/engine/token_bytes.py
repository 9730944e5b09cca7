"""Each token's own bytes, read from the tokenizer's vocabulary (OpenAI's logprob `bytes`).

Decoding one token gives text, and a token that holds part of a UTF-8 character (byte-level
BPE splits an emoji into three) decodes to U+FFFD: its bytes cannot come from its text.
They come from the vocabulary's token string, read by the rule of the tokenizer's decoder:

  - byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: a ByteLevel decoder, or a slow tokenizer
    with a byte_decoder): each character of the token string stands for one byte, through
    GPT-2's bytes_to_unicode table inverted;
  - sentencepiece style (Llama 2, Mistral, Gemma: a ByteFallback or Metaspace decoder):
    <0xNN> is the byte NN, "▁" a space, any other piece its UTF-8;
  - added tokens (<|im_start|>, ...) are their content's UTF-8, whatever the model;
  - anything else (a tokenizer of neither kind, a token string the table cannot read):
    the UTF-8 of the token decoded alone, the best that is known.

Invariant (tests/engine/test_token_bytes.py): for byte-level and byte-fallback
tokenizers, the bytes of a text's tokens, joined, are the text's UTF-8.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPIECE_SPACE = "\u2581"


@cache
def unicode_to_byte() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character each byte is spelled with -> the byte.
    Printable Latin-1 bytes stand for themselves; the other 68 are shifted to U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shift)] = b
            shift += 1
    return table


def decoder_kinds(hf_tokenizer: Any) -> set[str]:
    """The `type`s in the fast tokenizer's decoder (a Sequence lists its parts); empty when
    there is no fast tokenizer or no decoder."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except Exception:  # noqa: BLE001 - an unreadable config: fall back to decoding
        return set()
    kinds: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                kinds.add(node["type"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(decoder)
    return kinds


class TokenBytes:
    """token id -> its bytes, for one tokenizer (looked up once per id, then cached)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        kinds = decoder_kinds(hf_tokenizer)
        self.byte_level = "ByteLevel" in kinds or hasattr(hf_tokenizer, "byte_decoder")
        self.sentencepiece = bool(kinds & {"ByteFallback", "Metaspace"}) or hasattr(hf_tokenizer, "sp_model")
        added = getattr(hf_tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): str(t) for i, t in added.items()}
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        b = self.cache.get(token_id)
        if b is None:
            b = self.cache[token_id] = self.lookup(token_id)
        return b

    def lookup(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self.byte_level:
                table = unicode_to_byte()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            elif self.sentencepiece:
                m = BYTE_TOKEN.fullmatch(piece)
                return bytes([int(m.group(1), 16)]) if m else piece.replace(SPIECE_SPACE, " ").encode()
        return self.hf.decode([token_id]).encode()
