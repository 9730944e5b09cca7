"""The engine's warm-up (run by start() on CUDA) takes every kind of step once, so that
Triton builds their kernel variants before serving rather than in the middle of it: a step
longer than the CUDA graphs take (eager), in prompts that fit the context, and a mixed step
whose decodes go through the decode kernel (the split path), which serving takes only once
decodes hold `split_decode_tokens` of context. Here on CPU, watching the runner's steps."""

from __future__ import annotations

import asyncio

from streamer.engine.engine import AsyncEngine


def test_warm_up_runs_eager_steps_and_a_split_mixed_step(tiny_models):
    engine = AsyncEngine(
        model=str(tiny_models["llama3"]), device="cpu", max_model_len=100, cuda_graph_max_tokens=64,
        max_num_batched_tokens=256, max_num_seqs=8, warmup=False,
    )
    runner = engine.runner
    steps: list[tuple[int, int, int]] = []  # (tokens, sequences, decodes through the decode kernel)
    prepare = runner.prepare

    def watch(batch):
        x = prepare(batch)
        steps.append((int(x["input_ids"].shape[0]), len(batch.seqs), x["num_decodes"]))
        return x

    runner.prepare = watch
    threshold = runner.split_decode_tokens

    async def main() -> None:
        await engine.start()
        try:
            await engine._warm_up()
        finally:
            await engine.stop()

    asyncio.run(main())
    # 64 + 64 and 64 + 65 tokens: longer than the graphs take, each in 2 prompts (the context
    # holds 100 tokens)
    assert (128, 2, 0) in steps and (129, 2, 0) in steps, steps
    mixed = [s for s in steps if s[2] > 0]
    assert mixed and all(tokens > s_decodes for tokens, _, s_decodes in mixed), steps
    assert runner.split_decode_tokens == threshold, "the split threshold is restored"
