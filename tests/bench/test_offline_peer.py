"""`bench offline --peer vllm`: the vLLM peer through the team's peer tool, in a process of its
own; its result is the peer figure and a missing tool is a clear error. A stand-in tool (a
script with the tool's command line and result file) replaces vLLM, which CI cannot run."""

from __future__ import annotations

import argparse

import pytest

from streamer.bench import offline

FAKE_TOOL = '''
import argparse, json
p = argparse.ArgumentParser()
for a in ("--proj", "--site", "--workload", "--json", "--kv-cache-dtype", "--num-requests", "--quantization"):
    p.add_argument(a)
a = p.parse_args()
res = {"workload": a.workload, "engine": "vllm", "requests": int(a.num_requests or 1), "output_tokens": 256,
       "seconds": 2.0, "output_tokens_per_s": 128.0, "ms_per_output_token": 4.0, "kv": a.kv_cache_dtype,
       "proj": a.proj}
json.dump([res], open(a.json, "w"))
'''


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    offline.add_args(p)
    return p.parse_args(list(argv))


def test_peer_flag_forms():
    assert _args().peer == "transformers"
    assert _args("--peer").peer == "transformers"
    assert _args("--peer", "vllm").peer == "vllm"
    assert _args("--no-peer").peer is None
    with pytest.raises(SystemExit):
        _args("--peer", "sglang")


def test_vllm_peer_result_comes_from_the_tool(tmp_path):
    tool = tmp_path / "peer_bench.py"
    tool.write_text(FAKE_TOOL)
    (tmp_path / "site").mkdir()
    args = _args("--peer", "vllm", "--vllm-tool", str(tool), "--vllm-site", str(tmp_path / "site"),
                 "--num-requests", "3", "--kv-cache-dtype", "fp8")
    res = offline.run_vllm_peer(args, "W2")
    assert res == {"engine": "vllm", "requests": 3, "output_tokens": 256, "seconds": 2.0,
                   "output_tokens_per_s": 128.0, "ms_per_output_token": 4.0}


def test_vllm_peer_without_the_tool_names_what_is_missing(tmp_path):
    args = _args("--peer", "vllm", "--vllm-tool", str(tmp_path / "nope.py"), "--vllm-site", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--vllm-tool"):
        offline.run_vllm_peer(args, "W1")


def test_vllm_peer_failure_is_reported(tmp_path):
    tool = tmp_path / "peer_bench.py"
    tool.write_text("import sys, json\nsys.argv.index('--json')\n"
                    "json.dump([{'workload': 'W1', 'error': 'engine init failed'}], "
                    "open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    args = _args("--peer", "vllm", "--vllm-tool", str(tool), "--vllm-site", str(tmp_path))
    with pytest.raises(RuntimeError, match="engine init failed"):
        offline.run_vllm_peer(args, "W1")
