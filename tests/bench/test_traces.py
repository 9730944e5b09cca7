"""`streamer bench steps` and `streamer bench kernels` read the files the engine's diagnostics
write (STREAMER_STEP_TRACE, STREAMER_PROFILE_STEPS) and print where the time went."""

from __future__ import annotations

import json

from streamer.cli import main


def step(n: int, seqs: int, decodes: int, idle: float, t: float) -> dict:
    """One line of a step trace, the fields the summary reads (times in seconds)."""
    return {
        "step": n, "seqs": seqs, "tokens": decodes + 512 * (seqs - decodes), "decodes": decodes,
        "ahead": n > 1, "device": 0.010, "idle_before": idle, "mask_wait": 0.0,
        "launch_begin": t, "launch_end": t + 0.001, "launch_cpu": 0.0008, "ready": t + 0.011,
        "process_begin": t + 0.0112, "processed": t + 0.0115, "process_cpu": 0.0003,
        "loop_cpu": 0.01 * n, "gc": 0.0, "gc_count": 0,
    }


def test_steps_summarizes_device_and_host_time_by_kind_of_step(tmp_path, capsys):
    trace = tmp_path / "steps.jsonl"
    recs = [step(1, 4, 0, 0.0, 0.0), step(2, 4, 4, 0.0, 0.010), step(3, 4, 4, 0.001, 0.021),
            step(4, 4, 3, 0.0, 0.033)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in recs))
    main(["bench", "steps", str(trace)])
    out = capsys.readouterr().out
    assert out.startswith("4 steps over")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["decode"], ["mixed"],
                                                                                              ["prefill"])}
    assert [rows[k][1] for k in ("decode", "mixed", "prefill")] == ["2", "1", "1"]  # steps of each kind
    assert rows["decode"][6] == "1"  # one late decode step (idle before it > 0.2 ms)
    main(["bench", "steps", str(trace), "--skip", "1", "--last", "2"])
    assert capsys.readouterr().out.startswith("2 steps over")


def test_kernels_prints_one_table_per_profiled_step(tmp_path, capsys):
    profile = tmp_path / "kernel_profile.jsonl"
    rec = {"step": 300, "seqs": 8, "tokens": 8, "decodes": 8, "total_us": 1000.0, "span_us": 1200.0,
           "kernels": [["_decode_kernel", 32, 600.0, 50.0], ["gemm", 128, 400.0, 10.0]]}
    profile.write_text(json.dumps(rec) + "\n")
    main(["bench", "kernels", str(profile), "--top", "1"])
    out = capsys.readouterr().out
    assert "== step 300: decode, 8 seqs, 8 tokens" in out and "idle between kernels 0.06 ms" in out
    assert "_decode_kernel" in out and "gemm" not in out  # --top 1
    assert " 60.0%  x32" in out
