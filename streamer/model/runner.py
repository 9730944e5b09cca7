"""ModelRunner: owns the model and its PagePool; runs one packed step.

A step is packed (packing.py: the tokens of all sequences concatenated, no padding),
run (replayed from a CUDA graph, or eagerly: forward), and sampled (the sampler); its
tokens stay on the device until collect() brings them to the host, so the next step can
be launched first. Attention reads each sequence's earlier tokens through its page
table. Only the last position of a sequence that samples reaches the LM head.

The runner is driven from one worker thread (executor actor); it never touches
the event loop.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import msgspec
import torch

import kernels.common
from streamer.config import EngineConfig
from streamer.diagnostics import Diagnostics
from streamer.env import blas_library, use_l2_prefetch, use_pdl
from streamer.errors import ConfigError
from streamer.messages import Batch, LoraUpdate, SampledToken, StepOutput
from streamer.model.context import run_eager
from streamer.model.draft import DraftModel, Proposed
from streamer.model.eagle_draft import EagleDraft
from streamer.model.exact_verify import NO_GRAPHS, row_graphs, unavailable, verify_rows
from streamer.model.graphs import CaptureFailed, DecodeGraphs, ExtendGraphs, LoraGraphs
from streamer.model.kv_budget import make_pool
from streamer.model.launched import Launched, RowValues
from streamer.model.layers import Linear
from streamer.model.loader import load_model
from streamer.model.lora import Adapters
from streamer.model.packing import prepare
from streamer.model.tp_group import current as tensor_parallel
from streamer.model.tp_group import unsharded
from streamer.sampling.processing import edits_logits
from streamer.sampling.sampler import Plan, SampleInputs, Sampler
from streamer.staging import PinnedRing


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, diagnostics: Diagnostics | None = None) -> None:
        self.config = config
        self.device = pick_device(config.device)
        kernels.common.PDL = use_pdl()  # (before any kernel runs or a graph is captured)
        kernels.common.PREFETCH_BYTES = kernels.common.DEFAULT_PREFETCH_BYTES if use_l2_prefetch() else 0
        if (blas := blas_library()) is not None and self.device.type == "cuda":
            torch.backends.cuda.preferred_blas_library(blas)  # (process-wide: an A/B switch)
        torch.manual_seed(config.seed)
        self.model, self.hf_config = load_model(
            model_path,
            dtype=config.dtype,
            device=self.device,
            load_format=config.load_format,
            max_positions=config.max_model_len,
            seed=config.seed,
            quantization=config.quantization,
        )
        cfg = self.hf_config
        if self.device.type == "cuda" and config.decode_gemv:
            for m in self.model.modules():
                if isinstance(m, Linear):
                    m.decode_gemv = True
        self.max_model_len: int = int(config.max_model_len or getattr(cfg, "max_position_embeddings", 4096))
        self.dtype = self.model.embed_tokens.weight.dtype
        self.adapters = Adapters(self.model, self.dtype, config.lora_adapters)
        """The LoRA adapters served (model/lora.py): attached before the graphs; those loaded while
        serving come and go through update_lora."""
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.draft: DraftModel | None = None
        """speculative_config's draft_model (model/draft.py) or EAGLE head (model/eagle_draft.py):
        its KV in the same page ids."""
        spec = config.speculative_config
        from streamer.model.source import resolve_model

        tp = tensor_parallel()
        # under tensor parallelism rank 0 alone drafts, with a whole draft (no collective): the
        # other ranks receive the step with its proposals (distributed/runner.py)
        with unsharded():
            if spec is not None and spec.drafted and (tp is None or tp.rank == 0):
                draft_path = str(resolve_model(str(spec.model), config.cache_dir))
                if spec.method == "draft_model":
                    self.draft = DraftModel(draft_path, target_cfg=cfg, config=config, device=self.device,
                                            max_model_len=self.max_model_len, kv_dtype=self.kv_dtype)
                else:  # (before the graphs are captured: the target's forward then returns the head's features)
                    self.draft = EagleDraft(draft_path, target=self.model, target_cfg=cfg, target_path=model_path,
                                             config=config, device=self.device, max_model_len=self.max_model_len,
                                             kv_dtype=self.kv_dtype)
        if self.draft is not None and self.device.type == "cuda" and config.decode_gemv:
            for m in self.draft.model.modules():  # (as the target's, above)
                if isinstance(m, Linear):
                    m.decode_gemv = True
        self.pool = make_pool(self.model, self.hf_config, config, self.device, self.kv_dtype, self.draft)
        if self.draft is not None:
            graphs = self.device.type == "cuda" and config.cuda_graphs
            self.draft.make_pool(self.pool.num_pages, self.pool.page_size,
                                 min(config.max_num_seqs, config.cuda_graph_max_bs) if graphs else 0,
                                 self.pool.pages_for(self.max_model_len))
            self.pool.companions = self.draft.page_parts()  # (a host tier moves them with the page)
        self.sampler = Sampler(cfg.vocab_size, self.device)
        self.last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        self.last_rows: dict[str, int] = {}
        self.inputs_staging = PinnedRing()
        self.tokens_staging = PinnedRing()
        self.last_done: torch.cuda.Event | None = None
        """The newest step's `done` event (timing the device's idle time before the next)."""
        self.step_start: torch.cuda.Event | None = None
        self.graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None
        self.lora_graphs: LoraGraphs | None = None
        """The graphs of steps with LoRA adapters' tokens (made with the others)."""
        self.row_graphs: DecodeGraphs | None = None
        """ngram speculation: the verify steps of a lone request, as decode rows (model/exact_verify.py)."""
        self.split_decode_tokens = 65536
        """Mixed steps whose leading decodes hold at least this many context tokens run
        their attention split (see prepare)."""
        self.diagnostics = diagnostics if diagnostics is not None else Diagnostics.from_env()
        if self.device.type == "cuda" and config.cuda_graphs and getattr(self.model, "cuda_graphs_ok", True):
            self._capture_graphs()
        spec = config.speculative_config
        if self.device.type == "cuda" and spec is not None and spec.exact_verify and self.row_graphs is None:
            why_not = unavailable(config, self.hf_config, self.model) or NO_GRAPHS
            raise ConfigError(f"speculative_config exact_verify: {why_not}")

    def _capture_graphs(self) -> None:
        from kernels.attention import extend_block_m

        c = self.config
        max_pages = self.pool.pages_for(self.max_model_len)
        bs = min(c.max_num_seqs, c.cuda_graph_max_bs)
        self.graphs = DecodeGraphs(self.model, self.pool.k, self.pool.v, bs, max_pages)
        with torch.inference_mode():
            self.graphs.capture()
        self.row_graphs = row_graphs(self.model, self.pool, c, self.hf_config, max_pages, self.graphs.pool)
        tokens = min(c.cuda_graph_max_tokens, c.max_num_batched_tokens)
        if tokens > 1:
            block_m = extend_block_m(self.dtype, self.model.head_dim)
            self.extend_graphs = ExtendGraphs(
                self.model, self.pool.k, self.pool.v, tokens, c.max_num_seqs, max_pages, block_m, self.graphs.pool
            )
            with torch.inference_mode():
                self.extend_graphs.capture()
        self.lora_graphs = LoraGraphs(self.graphs, self.extend_graphs)

    def prepare(self, batch: Batch) -> dict[str, Any]:
        """Host lists -> the tensors of one forward (packing.prepare)."""
        g = self.row_graphs
        rows = verify_rows(batch, g.max_bs) if g is not None else None
        if g is not None and rows is not None and g.fits(len(rows.seqs), len(rows.seqs[0].page_table)):
            return prepare(
                rows, page_size=self.pool.page_size, device=self.device, staging=self.inputs_staging,
                graphs=g, extend_graphs=None, split_decode_tokens=self.split_decode_tokens,
                last_tokens=self.last_tokens, last_rows=self.last_rows, loras=self.adapters.index,
            )
        return prepare(
            batch, page_size=self.pool.page_size, device=self.device, staging=self.inputs_staging, graphs=self.graphs,
            extend_graphs=self.extend_graphs, split_decode_tokens=self.split_decode_tokens,
            last_tokens=self.last_tokens, last_rows=self.last_rows, loras=self.adapters.index,
            lora_graphs=(None, None) if self.lora_graphs is None else self.lora_graphs.current(self.adapters),
        )

    def before_forward(self, batch: Batch) -> None:
        """The step's batch as it will be computed (the draft's proposals in): the
        tensor-parallel rank 0 sends it to the other ranks here."""

    @torch.inference_mode()
    def forward(self, batch: Batch) -> tuple[torch.Tensor, RowValues]:
        """Logits [sampling sequences, vocab] in the model's dtype, and the prompt logprobs and
        embeddings asked for."""
        x = self.prepare(batch)
        out = self._forward(x)
        if self.draft is not None:  # the draft's KV of the same tokens (model/draft.py)
            self.draft.mirror(batch, x)
        return out

    def _forward(self, x: dict[str, Any]) -> tuple[torch.Tensor, RowValues]:
        if self.device.type == "cuda":
            # the step's device work starts here: its inputs are prepared, the kernels follow
            self.step_start = torch.cuda.Event(enable_timing=True)
            self.step_start.record()
        graph = x["graph"]
        try:
            if isinstance(graph, DecodeGraphs):
                return graph.replay(x), RowValues()  # the LM head is in the graph
            if isinstance(graph, ExtendGraphs):
                hidden = graph.replay(x)
                return self.model.compute_logits(hidden[x["last"]])[: x["n_sample"]], RowValues()
        except CaptureFailed as e:  # (a LoRA graph's lazy capture: this step and the next run eagerly)
            if self.lora_graphs is None:
                raise
            self.lora_graphs.turn_off(str(e))
        hidden = run_eager(self.model, x, self.pool.k, self.pool.v, x["num_decodes"],
                           self.pool.pages_for(self.max_model_len) * self.pool.page_size)  # (the graphs' width)
        prompt_logprobs: dict[str, list[float]] = {}
        prompt_tops: dict[str, list[list[tuple[int, float]]]] = {}
        prompt_ranks: dict[str, list[int]] = {}
        if x["lp_rows"]:
            rows = torch.tensor(x["lp_rows"], device=self.device)
            targets = torch.tensor(x["lp_targets"], device=self.device)
            logp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
            chosen = logp.gather(1, targets[:, None])
            values = chosen.squeeze(1).tolist()
            ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()  # (vLLM's rank: 1 + the tokens more likely)
            kmax = max(k for _, _, k in x["lp_owner"])
            top_v: list[list[float]] = []
            top_i: list[list[int]] = []
            if kmax:
                tv, ti = logp.topk(kmax, dim=-1)
                top_v, top_i = tv.tolist(), ti.tolist()
            i = 0
            for rid, n, k in x["lp_owner"]:
                prompt_logprobs[rid] = values[i : i + n]
                prompt_ranks[rid] = ranks[i : i + n]
                if k:
                    prompt_tops[rid] = [list(zip(top_i[j][:k], top_v[j][:k])) for j in range(i, i + n)]
                i += n
        embeddings: dict[str, list[float]] = {}
        if x["embed_rows"]:
            rows = torch.tensor([r for _, r in x["embed_rows"]], device=self.device)
            for (rid, _), row in zip(x["embed_rows"], hidden[rows].float().tolist()):
                embeddings[rid] = row
        logits = self.model.compute_logits(hidden[x["last"]])[: x["n_sample"]]
        return logits, RowValues(prompt_logprobs, prompt_tops, prompt_ranks, embeddings)

    def update_lora(self, update: LoraUpdate) -> None:
        """Load or unload a LoRA adapter between steps (engine/adapters.py); ModelLoadError: nothing changed."""
        self.adapters.update(update.key, update.adapter)

    def launch(self, batch: Batch) -> Launched:
        """Queue one step on the device. Greedy batches keep their tokens there (no sync),
        so the next batch can be launched before these values reach the host. A batch with
        masks_deferred only runs its forward: sample() finishes it once the masks are in."""
        if batch.step in self.diagnostics.profile_steps:  # (STREAMER_PROFILE_STEPS; empty: none)
            return self.diagnostics.profile(batch, lambda: self._launch(batch))
        return self._launch(batch)

    @torch.inference_mode()
    def _launch(self, batch: Batch) -> Launched:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.step_start = None
        if self.pool.fence is not None:  # the host tier's last write-back (it freed pages this step may reuse)
            torch.cuda.current_stream().wait_event(self.pool.fence)
        after = self.last_done
        proposed = None
        if self.draft is not None and batch.spec:
            batch, proposed = self.draft.propose(batch)
        self.before_forward(batch)
        logits, values = self.forward(batch)
        start = self.step_start
        if batch.masks_deferred:
            # everything of the sampling that the masks do not change is queued now
            if proposed is not None:
                proposed.logits = logits
            plan = self.sampler.plan(logits, self._sample_inputs(batch), masked=True)
            paused = None
            if start is not None:
                paused = torch.cuda.Event(enable_timing=True)
                paused.record()
            t1 = time.perf_counter()
            times = {"launch_begin": t0, "launch_end": t1, "launch_cpu": time.thread_time() - c0}
            return Launched(batch.step, None, None, values, plan=plan, batch=batch, start=start,
                            wall=t1 - t0, after=after, paused=paused, times=times, proposed=proposed)
        out = self._sample(batch, logits, values, proposed=proposed)
        t1 = time.perf_counter()
        out.start, out.after, out.wall = start, after, t1 - t0
        out.times = {"launch_begin": t0, "launch_end": t1, "launch_cpu": time.thread_time() - c0}
        return out

    @torch.inference_mode()
    def sample(self, launched: Launched, masks: Any) -> Launched:
        """Finish a step launched with masks_deferred, now that its bitmask is filled."""
        assert launched.batch is not None and launched.plan is not None
        t0, c0 = time.perf_counter(), time.thread_time()
        resumed = None
        if launched.paused is not None:
            resumed = torch.cuda.Event(enable_timing=True)
            resumed.record()
        batch = msgspec.structs.replace(launched.batch, masks=masks, masks_deferred=False)
        out = self._sample(batch, launched.plan.logits, launched.values, launched.plan,
                           proposed=launched.proposed)
        out.start, out.after = launched.start, launched.after
        out.paused, out.resumed = launched.paused, resumed
        t1 = time.perf_counter()
        out.wall = launched.wall + t1 - t0
        out.times = {**launched.times, "sample_begin": t0, "sample_end": t1, "sample_cpu": time.thread_time() - c0}
        return out

    @staticmethod
    def _sample_inputs(batch: Batch, rids: list[str] | None = None) -> SampleInputs:
        if rids is None:
            rids = row_ids(batch)
        return SampleInputs(batch.params, batch.histories, batch.banned, rids, batch.masks)

    def _sample(
        self, batch: Batch, logits: torch.Tensor, values: RowValues, plan: Plan | None = None,
        proposed: Proposed | None = None,
    ) -> Launched:
        """Sample a step (its plan made at launch when the masks were deferred) and queue the
        copy of its tokens to the host. proposed: the draft's proposals of its verify chunks
        (their non-greedy rows are decided by rejection sampling, model/draft.py)."""
        rids = row_ids(batch)
        sampled: list[SampledToken] | None = None
        if plan is None and _plain_greedy(batch):
            tokens = logits.argmax(-1)
        elif not rids:
            sampled, tokens = [], torch.zeros(0, dtype=torch.long, device=self.device)
        else:
            if plan is not None:
                out = self.sampler.finish(plan, batch.masks)
            else:
                out = self.sampler.sample(logits, self._sample_inputs(batch, rids))
            if isinstance(out, torch.Tensor):
                tokens = out  # still on the device, like the greedy fast path
            else:
                sampled = out  # logprobs were asked for: already on the host
                tokens = torch.tensor([t.token_id for t in sampled], dtype=torch.long, device=self.device)
        if proposed is not None and proposed.rows:
            raw = proposed.logits if proposed.logits is not None else logits
            tokens, decided = self.draft.resolve(tokens, raw, batch, proposed)  # type: ignore[union-attr]
            if sampled is not None:  # (the rows decided by rejection, with their logprobs where asked for)
                sampled = [decided.get(r) or msgspec.structs.replace(t, token_id=i)
                           for r, (t, i) in enumerate(zip(sampled, tokens.tolist()))]
        self.last_tokens, self.last_rows = tokens, {rid: i for i, rid in enumerate(rids)}
        done = None
        if sampled is None and tokens.is_cuda:
            # Queue the copy to the host right behind this step: a plain .tolist() later
            # would also wait for the step launched after this one.
            host = self.tokens_staging.take(tokens.numel())
            host.copy_(tokens, non_blocking=True)
            done = self.tokens_staging.record(timing=True)
            tokens = host
        self.last_done = done
        return Launched(batch.step, tokens, sampled, values, done,
                        drafts=proposed.drafts if proposed is not None else {})

    @staticmethod
    def collect(launched: Launched) -> StepOutput:
        """Wait for a launched step and bring its tokens to the host."""
        sampled = launched.sampled
        if sampled is None:
            if launched.done is not None:
                launched.done.synchronize()
            assert launched.tokens is not None, "a step awaiting its masks cannot be collected"
            sampled = [SampledToken(t) for t in launched.tokens.tolist()]
        idle = mask_wait = 0.0
        if launched.start is not None and launched.done is not None:
            device_time = launched.start.elapsed_time(launched.done) / 1e3
            if launched.after is not None:
                idle = max(0.0, launched.after.elapsed_time(launched.start) / 1e3)
            if launched.paused is not None and launched.resumed is not None:
                mask_wait = max(0.0, launched.paused.elapsed_time(launched.resumed) / 1e3)
        else:
            device_time = launched.wall  # the launch itself computed everything (CPU, or it synced)
        launched.times["ready"] = time.perf_counter()
        v = launched.values
        return StepOutput(launched.step, sampled, prompt_logprobs=v.prompt_logprobs,
                          prompt_top_logprobs=v.prompt_top_logprobs, prompt_ranks=v.prompt_ranks,
                          drafts=launched.drafts, embeddings=v.embeddings, device_time=device_time,
                          idle_before=idle, mask_wait=mask_wait, host_times=launched.times)

    def step(self, batch: Batch) -> StepOutput:
        return self.collect(self.launch(batch))

    def release(self) -> None:
        """Drop the model, its graphs, the KV pool and the draft's now (the engine stopped),
        not at garbage collection: a second engine in the process sizes its pool from the
        device memory left. Other actors still reference the pool: its tensors are emptied."""
        self.graphs = self.extend_graphs = self.row_graphs = None
        self.lora_graphs = None  # (they hold the base graphs, and those the KV pool's tensors)
        pools = [self.pool] + ([self.draft.pool] if self.draft is not None else [])
        for pool in pools:
            if pool is not None:
                pool.k = pool.v = pool.k_bytes = pool.v_bytes = torch.empty(0)
                pool.companions = []
        if self.draft is not None:
            self.draft.release()
        self.draft = None
        self.pool = None  # type: ignore[assignment]
        self.model = self.adapters.model = None  # type: ignore[assignment]
        self.last_tokens = torch.zeros(0, dtype=torch.long)
        if torch.cuda.is_available():
            # graphs caught in a reference cycle (a caller's wrapper of a replay) keep their memory
            # pools and the weights until the cycle collector runs: run it now, then hand back
            gc.collect()
            torch.cuda.empty_cache()


def row_ids(batch: Batch) -> list[str]:
    """The request of each sampling row (a verify chunk has num_draft + 1 rows, engine/spec)."""
    if batch.spec:
        return [s.request_id for s in batch.seqs if s.sample for _ in range(s.num_draft + 1)]
    return [s.request_id for s in batch.seqs if s.sample]


def _plain_greedy(batch: Batch) -> bool:
    return batch.masks is None and not any(batch.banned) and all(
        p.greedy
        and p.logprobs is None
        and not edits_logits(p)
        for p in batch.params
    )
