"""The grouped MoE GEMM's measured tile tables (kernels/moe_tiles.py): a card's table picks the
tiles by the experts' dtype and the mean rows per expert; a card without one keeps the
built-in rules; a malformed table is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import moe, moe_tiles

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def fake_card(monkeypatch):
    """tuned() on a CPU machine: the 'cuda' device is named as the test says, tables re-read."""
    names = {}
    monkeypatch.setattr(moe_tiles, "_device_name", lambda index: names["name"])
    moe_tiles.table_for.cache_clear()
    yield names
    moe_tiles.table_for.cache_clear()


def test_buckets_are_the_decode_mixed_and_prefill_ranges():
    assert [moe_tiles.bucket(m) for m in (0.1, 16, 16.5, 128, 129, 10_000)] == [16, 16, 128, 128, None, None]
    assert moe_tiles.slug(H100) == "nvidia_h100_80gb_hbm3"


def test_the_shipped_h100_table_picks_float8_and_int4_tiles_by_rows_per_expert(fake_card):
    fake_card["name"] = H100
    cuda = torch.device("cuda", 0)
    # W8's decode (1,024 pairs over 128 experts: 8 rows each), T 1,024 (64 rows), prefill (256 rows)
    assert moe.default_config(1024, 128, 2048, 768, "fp8", cuda) == moe.MoeConfig(16, 64, 256, 4, 3)
    assert moe.default_config(8192, 128, 2048, 768, "fp8", cuda) == moe.MoeConfig(64, 64, 128, 4, 3)
    assert moe.default_config(32768, 128, 2048, 768, "fp8", cuda) == moe.MoeConfig(64, 256, 128, 8, 3)
    # int4 experts have their own entries (prefill: 128 x 128 x 64, where bf16's rule says 64 x 256 x 64)
    assert moe.default_config(1024, 128, 2048, 768, "int4", cuda) == moe.MoeConfig(16, 64, 128, 4, 3)
    assert moe.default_config(32768, 128, 2048, 768, "int4", cuda) == moe.MoeConfig(128, 128, 64, 8, 3)
    # the table has no bf16 entries: bf16 experts keep the built-in rules, as any other card does
    assert moe.default_config(1024, 128, 2048, 768, "bf16", cuda) == moe.default_config(1024, 128, 2048, 768)
    fake_card["name"] = "Some Other GPU"
    assert moe.default_config(1024, 128, 2048, 768, "fp8", cuda) == moe.default_config(1024, 128, 2048, 768)


def test_tiny_shapes_still_cap_the_table_tiles(fake_card):
    fake_card["name"] = H100
    cfg = moe.default_config(64, 8, 32, 16, "fp8", torch.device("cuda", 0))
    assert (cfg.block_n, cfg.block_k) == (16, 16)


def test_cpu_tensors_never_read_a_table():
    assert moe_tiles.tuned(torch.device("cpu"), "fp8", 8.0) is None


def test_an_unknown_kind_is_a_programming_error():
    with pytest.raises(AssertionError):
        moe_tiles.tuned(torch.device("cpu"), "int8", 8.0)


def test_write_merges_one_dtype_and_the_env_table_wins(tmp_path, monkeypatch, fake_card):
    path = tmp_path / "card.json"
    moe_tiles.write(path, "Card", "fp8", {16: (16, 64, 256, 4, 3), 128: (64, 64, 128, 4, 3), None: (64, 256, 128, 8, 3)})
    moe_tiles.write(path, "Card", "bf16", {16: (16, 64, 128, 4, 3), None: (64, 256, 64, 8, 3)})
    table = json.loads(path.read_text())
    assert [e["max_rows"] for e in table["fp8"]] == [16, 128, None] and len(table["bf16"]) == 2
    monkeypatch.setenv(moe_tiles.ENV, str(path))
    fake_card["name"] = H100  # (the env table is used whatever the card)
    assert moe_tiles.tuned(torch.device("cuda", 0), "bf16", 100.0) == (64, 256, 64, 8, 3)
    assert moe_tiles.tuned(torch.device("cuda", 0), "fp8", 100.0) == (64, 64, 128, 4, 3)


@pytest.mark.parametrize(
    "table, message",
    [
        ([], "JSON object"),
        ({"fp8": [{"max_rows": None, "tiles": [16, 64]}]}, "needs tiles"),
        ({"fp8": [{"max_rows": 16, "tiles": [16, 64, 128, 4, 3]}]}, "max_rows null"),
    ],
)
def test_a_malformed_table_is_refused_with_its_path(tmp_path, monkeypatch, fake_card, table, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(moe_tiles.ENV, str(path))
    fake_card["name"] = H100
    with pytest.raises(ValueError, match=message) as err:
        moe_tiles.tuned(torch.device("cuda", 0), "fp8", 8.0)
    assert str(path) in str(err.value)
