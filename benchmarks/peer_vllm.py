"""The vLLM peer tool (../shared/peer, copied to .peer) with two things it lacks: tensor
parallelism and another model shape than the workload's own. It runs the tool itself, with
`tensor_parallel_size` added to vLLM's engine arguments and the workload's model replaced by a
folder of benchmarks/configs, so that the prompts, the warm-up and the timing stay the tool's:

    python3 benchmarks/peer_vllm.py [--tensor-parallel-size N] [--model SHAPE] [--tool .peer/vllm/peer_bench.py] \\
        --proj . --site .peer/site --workload W2 --json out.json      # the tool's own options follow

`streamer bench offline --peer vllm` calls it when it is given --tensor-parallel-size > 1 or a
--model-dir of benchmarks/configs. The tool runs each workload in a child process of its own
file; here the child is this file again (the tool's module is told it is this file), and the
two settings reach it through the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

TP_ENV, MODEL_ENV, TOOL_ENV = "STREAMER_PEER_TP", "STREAMER_PEER_MODEL", "STREAMER_PEER_TOOL"


def main() -> None:
    # no abbreviations: the tool passes its children `--mode`, which would otherwise be taken for --model
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--tensor-parallel-size", type=int, default=None)
    p.add_argument("--model", default=None, help="a folder name of benchmarks/configs")
    p.add_argument("--tool", default=None, help="the peer tool's runner (default .peer/vllm/peer_bench.py)")
    ours, rest = p.parse_known_args()
    # the parent's settings, for the children the tool starts (they get only the tool's options)
    if ours.tensor_parallel_size is not None:
        if ours.tensor_parallel_size < 1:
            raise SystemExit(f"--tensor-parallel-size must be >= 1, got {ours.tensor_parallel_size}")
        os.environ[TP_ENV] = str(ours.tensor_parallel_size)
    if ours.model is not None:
        os.environ[MODEL_ENV] = ours.model
    if ours.tool is not None:
        os.environ[TOOL_ENV] = str(Path(ours.tool).resolve())
    tool = Path(os.environ.get(TOOL_ENV) or ".peer/vllm/peer_bench.py").resolve()
    if not tool.is_file():
        raise SystemExit(f"no peer tool at {tool}: copy ../shared/peer to .peer (or pass --tool)")
    os.environ[TOOL_ENV] = str(tool)
    sys.path.insert(0, str(tool.parent))
    import peer_bench  # noqa: PLC0415 - found through the tool's folder

    tp = int(os.environ.get(TP_ENV) or 1)
    model = os.environ.get(MODEL_ENV)
    engine_kwargs, load_offline = peer_bench.engine_kwargs, peer_bench.load_offline

    def kwargs_with_tp(*a: Any) -> dict[str, Any]:
        kw = engine_kwargs(*a)
        if tp > 1:
            kw["tensor_parallel_size"] = tp
        return kw

    def offline_with_model(proj: Path) -> Any:
        offline = load_offline(proj)
        if model:
            if not (proj / "benchmarks" / "configs" / model / "config.json").is_file():
                raise SystemExit(f"--model {model}: no benchmarks/configs/{model}/config.json under {proj}")
            make = offline.make_workload

            def make_workload(*a: Any, **kw: Any) -> Any:
                return dataclasses.replace(make(*a, **kw), model=model)

            offline.make_workload = make_workload
        return offline

    peer_bench.engine_kwargs = kwargs_with_tp
    peer_bench.load_offline = offline_with_model
    peer_bench.__file__ = str(Path(__file__).resolve())  # the tool's children run this file
    sys.argv = [str(tool), *rest]
    peer_bench.main()


if __name__ == "__main__":
    main()
