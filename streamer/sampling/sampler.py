"""Turn the last-position logits of a batch into tokens.

Order (one definition, used for sampling and for reported logprobs):
  logits -> logit_bias -> repetition / presence / frequency penalties
         -> grammar bitmask -> banned tokens (EOS before min_tokens)
         = the processed distribution (logprobs are its log_softmax)
         -> temperature -> top-k -> top-p -> min-p -> draw.
Both masks set logits to -inf, so their order does not matter, except that a
ban never empties a row: when the grammar allows only banned tokens (it must
end, min_tokens says not yet) the grammar wins and the ban is dropped.

On CUDA, a batch without top-k / top-p rows, bans or logprobs is drawn by one kernel
(kernels.sampling.draw: bitmask, temperature, min-p and the inverse-CDF draw as it
reads the logits, on the rows whose request has a grammar); the torch path of
processing.py and draw.py is its definition and the path of every other batch.

Greedy rows (temperature 0) take the argmax of the processed logits; a batch
of greedy rows without penalties, masks or logprobs takes a pure argmax fast
path. Every step is vectorized over the batch: per-row knobs become [rows]
tensors; biases, bans and penalties are one sparse scatter each over the
(row, token) pairs they touch, never a dense [rows, vocab] pass per knob.

A draw is an inverse-CDF lookup: one uniform u per row, the first token whose
cumulative probability exceeds u (float64 cumsum). Rows with top-k / top-p
work on the K most probable tokens (K = max(TOP_CANDIDATES, largest top_k))
from one topk, not a full-vocabulary sort; a top-p row whose nucleus does not
fit in those K (a very flat distribution) falls back to a full sort.

A seeded row takes its uniform from a hash of (seed, number of output tokens
so far): the draw of a request depends on nothing else, so a seed reproduces
its output whatever shares the batch, across preemptions, on any device, and
with no per-request state to forget. Unseeded rows draw from torch's global
CPU generator (seeded from EngineConfig.seed by the runner).

Modules: processing.py (bias, penalties, bitmask, bans: the processed distribution),
draw.py (the draw's inputs, the draw, logprobs), this one (the Sampler that runs them,
planned before the grammar masks are in and finished once they are).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from streamer.messages import SampledToken, SamplingParams
from streamer.sampling.draw import (
    MIN_TEMPERATURE,
    TOP_CANDIDATES,
    DrawInputs,
    draw_inputs,
    draw_seed,
    draw_tokens,
    draw_uniform,
    filtered_probs,
    inverse_cdf,
    kernel_inputs,
    one_kernel_row,
    package,
    top_filtered_draw,
)
from streamer.sampling.processing import (
    BIAS_CACHE,
    LOGIT_MAX,
    BiasCache,
    apply_bitmask,
    bias_and_penalties,
    edits_logits,
    mask_and_ban,
    upload_bitmask,
)
from streamer.staging import PinnedRing

__all__ = [
    "BIAS_CACHE", "LOGIT_MAX", "MIN_TEMPERATURE", "TOP_CANDIDATES", "DrawInputs", "Plan", "SampleInputs",
    "Sampler", "apply_bitmask", "draw_seed", "draw_uniform", "filtered_probs", "inverse_cdf", "top_filtered_draw",
    "upload_bitmask",
]

@dataclass
class Plan:
    """A step's sampling up to the grammar bitmask (Sampler.plan -> Sampler.finish)."""

    logits: torch.Tensor
    inp: SampleInputs
    done: torch.Tensor | None = None
    """Set when nothing is left to do: the pure argmax fast path."""
    draw: DrawInputs | None = None


@dataclass
class SampleInputs:
    params: list[SamplingParams]
    histories: list[list[int]]
    """Output tokens so far of each row (penalties; the position of seeded draws)."""
    banned: list[list[int]] = field(default_factory=list)
    """Token ids that must not be drawn now, per row (EOS before min_tokens)."""
    request_ids: list[str] = field(default_factory=list)
    bitmask: torch.Tensor | None = None
    """int32 [rows, ceil(V/32)] xgrammar bitmask (a row of all ones = unconstrained), or None."""


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # grammar bitmasks (1 MB at batch 64 and a 128k vocabulary) go up through pinned
        # buffers: from pageable memory the copy waited for the forward in flight
        self.staging = PinnedRing() if self.device.type == "cuda" else None
        self.one_kernel = self.device.type == "cuda"
        """Draw with kernels.sampling where a batch allows it (CPU: the torch path; tests may
        turn it on there, to run the kernel through the Triton interpreter)."""
        self._biases: BiasCache = OrderedDict()
        """id(params.logit_bias) -> (that dict, kept so the id stays its own; token ids;
        biases): a request's bias, as tensors, built at its first step rather than at every
        one (a 49k-entry bias at n=64 took the step from ~20 ms to ~1 s in Python loops)."""

    def forget(self, request_id: str) -> None:
        """Kept for callers; seeded draws hold no per-request state."""

    def __call__(self, logits: torch.Tensor, inp: SampleInputs) -> list[SampledToken]:
        out = self.sample(logits, inp)
        return [SampledToken(t) for t in out.tolist()] if isinstance(out, torch.Tensor) else out

    def sample(self, logits: torch.Tensor, inp: SampleInputs) -> torch.Tensor | list[SampledToken]:
        """The chosen token ids, left on the device when no row asks for logprobs (so the
        host need not wait for the step); with logprobs, the packaged tokens."""
        return self.finish(self.plan(logits, inp, masked=inp.bitmask is not None), inp.bitmask)

    def plan(self, logits: torch.Tensor, inp: SampleInputs, masked: bool) -> Plan:
        """Everything of `sample` that does not depend on the grammar bitmask: bias and
        penalties applied, the draw's per-row inputs on the device. masked: a bitmask will be
        given to `finish`. A step whose masks are filled while its forward runs (the
        scheduler's masks_deferred) plans at once and finishes when they arrive, so little
        is left to queue on the device once the masks are in."""
        params = inp.params
        logits = logits[:, : self.vocab_size]
        arithmetic = any(edits_logits(p) for p in params)
        edits = masked or arithmetic or any(inp.banned)
        if not edits and all(p.greedy and p.logprobs is None for p in params):
            return Plan(logits, inp, done=logits.argmax(-1))
        # On CUDA the common case (no top-k / top-p, bans or logprobs) is one kernel that applies
        # the bitmask while it reads the logits (kernels.sampling): nothing is written to them
        one_kernel = self.one_kernel and not any(inp.banned) and all(one_kernel_row(p, logits.shape[1]) for p in params)
        writes = arithmetic or (edits and not one_kernel)  # (the torch path masks in place)
        if logits.dtype != torch.float32 and (writes or not one_kernel):
            logits = logits.float()
        elif writes:
            logits = logits.clone()
        if arithmetic:
            bias_and_penalties(logits, params, inp.histories, self._biases)
            # Valid but extreme knobs (a repetition penalty of 1e-300 is 0 in float32) can
            # overflow: keep every logit finite or -inf, so no row turns into NaN. (Masks and
            # bans, applied later, only write -inf: nothing to do for them.)
            logits.nan_to_num_(nan=float("-inf"), posinf=LOGIT_MAX, neginf=float("-inf")).clamp_(max=LOGIT_MAX)
        if one_kernel:
            return Plan(logits, inp, draw=kernel_inputs(logits, params, inp.histories))
        return Plan(logits, inp, draw=draw_inputs(logits, params, inp.histories))

    def finish(self, plan: Plan, bitmask: torch.Tensor | None) -> torch.Tensor | list[SampledToken]:
        """`sample` of a plan, given its bitmask (or None)."""
        if plan.done is not None:
            return plan.done
        logits, inp = plan.logits, plan.inp
        assert plan.draw is not None
        if plan.draw.kernel is not None:
            return self._kernel_draw(logits, plan.draw, bitmask)
        mask_and_ban(logits, inp.banned, bitmask, self.staging)
        chosen = draw_tokens(logits, plan.draw)
        if all(p.logprobs is None for p in inp.params):
            return chosen
        return package(logits, chosen, inp.params)

    def _kernel_draw(self, logits: torch.Tensor, d: DrawInputs, bitmask: torch.Tensor | None) -> torch.Tensor:
        from kernels.sampling import draw

        words = None
        if bitmask is not None and d.kernel_masked:
            if bitmask.shape[0] < d.n:  # (a row without its mask row is unconstrained)
                bitmask = torch.cat([bitmask, bitmask.new_full((d.n - bitmask.shape[0], bitmask.shape[1]), -1)])
            words = upload_bitmask(bitmask, logits.device, self.staging)
        return draw(logits, words, d.kernel, d.kernel_min_p)
