"""A step queued on the device (ModelRunner.launch) until its tokens reach the host
(ModelRunner.collect), and what a step computed besides its logits (RowValues)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamer.messages import Batch, SampledToken
from streamer.model.draft import Proposed
from streamer.sampling.sampler import Plan


@dataclass(slots=True)
class RowValues:
    """What a step computed besides its logits, per request: prompt logprobs (the logprob of
    each position's next token and its rank, and where asked for, SeqChunk.logprob_top, the top (id,
    logprob) there) and embeddings (SeqChunk.embed: the final hidden state at its last position)."""

    prompt_logprobs: dict[str, list[float]] = field(default_factory=dict)
    prompt_top_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    prompt_ranks: dict[str, list[int]] = field(default_factory=dict)
    """Of each position's next token: its rank in the vocabulary (1: the most likely)."""
    embeddings: dict[str, list[float]] = field(default_factory=dict)



@dataclass(slots=True)
class Launched:
    step: int
    tokens: torch.Tensor | None
    """Sampled token ids, one per sampling sequence (a pinned host copy in flight on CUDA);
    None while the step awaits its grammar masks."""
    sampled: list[SampledToken] | None
    """Already on the host (non-greedy sampling syncs), or None."""
    values: RowValues
    done: torch.cuda.Event | None = None
    """Recorded after the copy of `tokens` to the host; None when nothing is in flight."""
    plan: Plan | None = None
    """Kept while the step awaits its grammar masks (masks_deferred): its sampling so far."""
    batch: Batch | None = None
    start: torch.cuda.Event | None = None
    """Recorded (with timing) once the inputs are prepared, before the step's kernels."""
    after: torch.cuda.Event | None = None
    """The `done` of the step launched before this one (the device's idle time between)."""
    wall: float = 0.0
    """Host seconds launch() took (all of the step where it computed synchronously)."""
    paused: torch.cuda.Event | None = None
    """masks_deferred on CUDA: recorded after the forward; the sampling follows once the masks
    are in, behind `resumed` (the gap is the device's wait for the masks)."""
    resumed: torch.cuda.Event | None = None
    times: dict[str, float] = field(default_factory=dict)
    """Host milestones (StepOutput.host_times)."""
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """StepOutput.drafts."""
    proposed: Proposed | None = None
    """A step awaiting its masks: its draft proposals, decided when it is sampled."""

    @property
    def awaiting_masks(self) -> bool:
        return self.tokens is None and self.sampled is None
