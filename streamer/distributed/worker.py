"""A tensor-parallel rank other than 0: `python -m streamer.distributed.worker ARGS_JSON`
(started by launch.Workers).

It joins the group, builds its ModelRunner (its shard of the weights, its own KV pool,
CUDA graphs), then runs the steps rank 0 broadcasts until RankStop (runner.follow_steps).
It ignores SIGINT (Ctrl-C reaches the whole process group: rank 0 stops it in order) and
exits when the process that started it is gone (no orphan holds a GPU). A failure before
the steps begin is written to the store (error/<rank>) for rank 0 to raise.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="streamer-tp-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(os.getppid())
    args = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {args['rank']} %(name)s: %(message)s")

    import msgspec
    import torch

    from streamer.config import EngineConfig
    from streamer.distributed.checks import rank_device
    from streamer.distributed.launch import _store
    from streamer.distributed.runner import follow_steps
    from streamer.distributed.step import StepChannel
    from streamer.kv.host import HostTier
    from streamer.model import tp_group as tp
    from streamer.model.runner import ModelRunner

    rank, local_rank = args["rank"], args["local_rank"]
    store = _store(args["addr"], args["port"], master=False)
    started = False
    try:
        config = msgspec.convert(args["config"], EngineConfig)
        device = rank_device(config, local_rank)
        per_node = config.tensor_parallel_size // config.nnodes
        if device.type == "cpu":  # (this node's ranks share its cores)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
        config.device = str(device)
        store.set(f"joined/{rank}", "1")
        group = tp.init(rank, config.tensor_parallel_size, local_rank, device, store)
        with tp.building(group):
            runner = ModelRunner(config, args["model_path"])
        # (this rank's shard of the host tier: rank 0's scheduler decides its copies)
        tier = HostTier.of_size(runner.pool, config.host_kv_cache_gb)
        channel = StepChannel(group)
        started = True
        follow_steps(runner, channel, tier)
    except Exception as e:  # noqa: BLE001 - reported to rank 0 (or, once serving, the group is broken)
        if not started:
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        logging.getLogger("streamer.distributed").error("rank %d: %s", rank, e, exc_info=started)
        return 1
    tp.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
