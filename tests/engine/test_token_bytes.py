"""A token's own bytes (OpenAI's logprob `bytes`), read from the vocabulary: joined over a
text's tokens they are the text's UTF-8, also where a token holds part of a character."""

from __future__ import annotations

from typing import Any

import pytest

from streamer.engine.token_bytes import TokenBytes, unicode_to_byte

TEXT = "héllo 👋 wörld, naïve café — 日本語"


@pytest.fixture(scope="module")
def smol(default_model) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model))


def sentencepiece_style() -> Any:
    """A Llama-2-style tokenizer: "▁" for spaces, <0xNN> byte tokens for what the pieces lack."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "c", "a", "f", "n", "i", "v", ",", "—"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_gpt2_s_byte_table_spells_each_byte_once():
    table = unicode_to_byte()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["a"] == ord("a")


def test_byte_level_bpe_tokens_join_to_the_text_s_utf8(smol):
    ids = smol(TEXT, add_special_tokens=False)["input_ids"]
    tb = TokenBytes(smol)
    assert b"".join(tb(i) for i in ids) == TEXT.encode()


def test_a_token_that_is_part_of_a_character_gives_its_raw_bytes(smol):
    ids = smol(" 👋", add_special_tokens=False)["input_ids"]
    tb = TokenBytes(smol)
    assert [tb(i) for i in ids] == [b" \xf0\x9f", b"\x91", b"\x8b"]
    assert all("\ufffd" in smol.decode([i]) for i in ids)  # what the token's text cannot say


def test_every_token_that_decodes_whole_has_its_text_s_bytes(smol):
    tb = TokenBytes(smol)
    for i in range(len(smol)):
        text = smol.decode([i])
        if "\ufffd" not in text:
            assert tb(i) == text.encode(), (i, smol.convert_ids_to_tokens(i))


def test_added_tokens_are_their_content(smol):
    tb = TokenBytes(smol)
    assert tb(1) == b"<|im_start|>" and tb(2) == b"<|im_end|>"


def test_sentencepiece_byte_tokens_and_spaces():
    sp = sentencepiece_style()
    tb = TokenBytes(sp)
    ids = sp(TEXT, add_special_tokens=False)["input_ids"]
    assert "<0xC3>" in sp.convert_ids_to_tokens(ids)  # é is two byte tokens here
    # the first piece's "▁" is the space the normalizer prepended (the decoder strips it)
    assert b"".join(tb(i) for i in ids) == b" " + TEXT.encode()
    assert tb(sp.convert_tokens_to_ids("<0xF0>")) == b"\xf0" and tb(sp.convert_tokens_to_ids("▁")) == b" "
    assert tb(1) == b"<s>"
