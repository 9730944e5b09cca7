"""`bench offline --peer vllm`: the vLLM peer through the team's peer tool, in a process of its
own; its result is the peer figure and a missing tool is a clear error. With tensor parallelism
or another benchmark shape, benchmarks/peer_vllm.py runs the tool with them. Stand-in tools (a
script with the tool's command line and result file; a module with its functions and its
child process) replace vLLM, which CI cannot run."""

from __future__ import annotations

import argparse

import pytest

from streamer.bench import offline, peers

FAKE_TOOL = '''
import argparse, json
p = argparse.ArgumentParser()
for a in ("--proj", "--site", "--workload", "--json", "--kv-cache-dtype", "--num-requests", "--quantization",
          "--max-num-seqs"):
    p.add_argument(a)
a = p.parse_args()
res = {"workload": a.workload, "engine": "vllm", "requests": int(a.num_requests or 1), "output_tokens": 256,
       "seconds": 2.0, "output_tokens_per_s": 128.0, "ms_per_output_token": 4.0, "kv": a.kv_cache_dtype,
       "proj": a.proj}
if a.max_num_seqs:
    res["engine_args"] = {"max_num_seqs": int(a.max_num_seqs)}
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
    res = peers.run_vllm_peer(args, "W2")
    assert res == {"engine": "vllm", "requests": 3, "output_tokens": 256, "seconds": 2.0,
                   "output_tokens_per_s": 128.0, "ms_per_output_token": 4.0}


def test_vllm_peer_without_the_tool_names_what_is_missing(tmp_path):
    args = _args("--peer", "vllm", "--vllm-tool", str(tmp_path / "nope.py"), "--vllm-site", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--vllm-tool"):
        peers.run_vllm_peer(args, "W1")


def test_vllm_peer_failure_is_reported(tmp_path):
    tool = tmp_path / "peer_bench.py"
    tool.write_text("import sys, json\nsys.argv.index('--json')\n"
                    "json.dump([{'workload': 'W1', 'error': 'engine init failed'}], "
                    "open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    args = _args("--peer", "vllm", "--vllm-tool", str(tool), "--vllm-site", str(tmp_path))
    with pytest.raises(RuntimeError, match="engine init failed"):
        peers.run_vllm_peer(args, "W1")


def test_max_num_seqs_reaches_the_peer_only_when_given(tmp_path):
    tool = tmp_path / "peer_bench.py"
    tool.write_text(FAKE_TOOL)
    (tmp_path / "site").mkdir()
    common = ("--peer", "vllm", "--vllm-tool", str(tool), "--vllm-site", str(tmp_path / "site"))
    assert "engine_args" not in peers.run_vllm_peer(_args(*common), "W3")
    assert peers.run_vllm_peer(_args(*common, "--max-num-seqs", "32"), "W3")["engine_args"] == {"max_num_seqs": 32}


# The tool's structure as benchmarks/peer_vllm.py relies on it: engine_kwargs and load_offline at
# module level, and main() running each workload in a child process of its own __file__.
FAKE_PEER_BENCH = '''
import argparse, json, subprocess, sys
from pathlib import Path

def engine_kwargs(args, model_dir, max_model_len, mode):
    return {"model": str(model_dir), "max_model_len": max_model_len}

def load_offline(proj):
    sys.path.insert(0, str(proj))
    from streamer.bench import offline
    return offline

def child(a):
    w = load_offline(Path(a.proj)).make_workload(a.child, 1000, None)
    kw = engine_kwargs(a, Path("/models") / w.model, 2048, "default")
    return {"workload": a.child, "engine": "vllm", "requests": 1, "output_tokens": 256, "seconds": 2.0,
            "output_tokens_per_s": 128.0, "model": w.model, "engine_args": {k: v for k, v in kw.items() if k != "model"}}

def main():
    p = argparse.ArgumentParser()
    for a in ("--proj", "--site", "--workload", "--json", "--kv-cache-dtype", "--num-requests", "--max-num-seqs",
              "--quantization", "--child", "--result", "--mode"):
        p.add_argument(a)
    a = p.parse_args()
    if a.child:
        Path(a.result).write_text(json.dumps(child(a)))
        return
    out = Path(a.json + ".child")
    # as the real tool: --mode, a prefix of peer_vllm.py's --model
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", a.workload, "--mode", "default",
                    "--result", str(out), "--proj", a.proj], check=True)
    Path(a.json).write_text(json.dumps([json.loads(out.read_text())]))

if __name__ == "__main__":
    main()
'''


def test_tensor_parallelism_and_another_shape_reach_the_tools_child(tmp_path):
    tool = tmp_path / "peer_bench.py"
    tool.write_text(FAKE_PEER_BENCH)
    (tmp_path / "site").mkdir()
    args = _args("--peer", "vllm", "--vllm-tool", str(tool), "--vllm-site", str(tmp_path / "site"),
                 "--tensor-parallel-size", "2", "--model-dir", str(peers.CONFIGS / "llama-3.1-70b"))
    res = peers.run_vllm_peer(args, "W2")
    assert res["model"] == "llama-3.1-70b", "the workload's model, replaced in the child"
    assert res["engine_args"] == {"max_model_len": 2048, "tensor_parallel_size": 2}


def test_the_peer_takes_only_benchmark_shapes(tmp_path):
    tool = tmp_path / "peer_bench.py"
    tool.write_text(FAKE_PEER_BENCH)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    args = _args("--peer", "vllm", "--vllm-tool", str(tool), "--vllm-site", str(tmp_path),
                 "--model-dir", str(tmp_path / "model"))
    with pytest.raises(ValueError, match="shape of"):
        peers.run_vllm_peer(args, "W2")



def test_the_floor_is_this_devices_copy_bandwidth():
    """Off a GPU the floor is the H200's (4.25 TB/s, as measured there); the table says which rate
    its floor% divides by."""
    import contextlib
    import io

    from streamer.bench import offline

    assert offline.bandwidth() == offline.BANDWIDTH == 4.25e12
    res = offline.Result("W2", 1, 256, 1.0, 256.0, ms_per_output_token=4.2, floor_fraction=0.9)
    res.extra["bandwidth_tb_s"] = 3.3
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        offline.print_table([res])
    assert out.getvalue().splitlines()[0].startswith("floor% against 3.30 TB/s of copy bandwidth")
