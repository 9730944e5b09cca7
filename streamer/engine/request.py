"""Per-request state, owned by the scheduler actor alone."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamer.kv.radix import Node
from streamer.messages import SamplingParams

PLACEHOLDER = -1
"""A token being sampled by a batch in flight; the runner reads its value on the device."""


class Status(enum.IntEnum):
    """Ordered so that `status >= Status.FINISHED` means done."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_len: int
    tokens: list[int]
    """Prompt then output tokens. KV exists for tokens[:num_computed]. Output tokens of
    batches still in flight are PLACEHOLDERs until their StepOutput is processed."""
    params: SamplingParams
    eos_token_ids: frozenset[int]
    grammar: Any = None
    """A sampling.grammar.GrammarState, or None."""
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    """This request's page table: one reference held on each page but the released ones."""
    released: int = 0
    """Sliding window: pages[:released] hold keys that no query of this request will see
    again; their references are dropped and their entries are 0 (the scratch page), so the
    table keeps one entry per page of positions (Pages.trim)."""
    node: Node | None = None
    """Radix node locked on behalf of this request (its cached prefix)."""
    cached_tokens: int = 0
    """Prompt tokens served from the radix cache at first admission."""
    admitted_once: bool = False
    queue_time: float | None = None
    """Seconds from arrival at the scheduler to first admission into a batch."""
    preemptions: int = 0
    sent_prompt_info: bool = False
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    suspect: bool = False
    """A step failed with this request among others: its next step runs alone, so that a
    failure caused by one request fails that request only."""
    claim: int | None = None
    """Hash of the first page this request computes beyond its cached prefix, from admission
    until its prompt is in the radix tree (requests needing that page wait for it)."""
    deadline: float | None = None
    """time.monotonic() at which it ends with finish_reason "timeout" (SamplingParams.timeout)."""
    cached_host_tokens: int = 0
    """Of cached_tokens, those whose KV came back from the host tier (kv/host.py)."""
    draft: list[int] = field(default_factory=list)
    """Speculative decoding: the proposals chosen for the batch being built (spec/rollback.py);
    BatchBuilder.build sends them and clears this."""
    verifying: bool = False
    """Speculative decoding: a verify chunk of it is in flight (how many tokens it keeps is
    unknown until it is back: nothing of it is scheduled ahead)."""
    spec_misses: int = 0
    """Speculative decoding with overlap: its proposal attempts in a row that found nothing."""
    ahead_left: int = 0
    """Of those, how many of its next steps may still be scheduled ahead without proposals
    before it waits for its tokens to try again (spec/rollback.py: ahead_budget)."""
    prediction: np.ndarray | None = None
    """SamplingParams.prediction's token ids, int64: ngram speculation's proposals' source; sent back
    with the first delta (RequestOutput.prediction_token_ids)."""
    prediction_at: int = 0
    """Where in prediction the output was last aligned (spec/ngram.py: from_prediction)."""

    bad_words: list[list[int]] | None = None
    """SamplingParams.bad_words tokenized (TokenizedRequest.bad_words)."""

    def bans(self, output: list[int] | None = None) -> list[int]:
        """The tokens bad_words forbid after `output` (default: this request's output so far, of
        which only the last tokens a sequence could match are read: no copy of a long output every
        step): each sequence's last token where the output ends with the rest of it (a one-token
        sequence's always)."""
        if output is None:
            keep = max((len(seq) for seq in self.bad_words or ()), default=1) - 1
            output = self.tokens[max(self.prompt_len, len(self.tokens) - keep):] if keep else []
        out: set[int] = set()
        for seq in self.bad_words or ():
            head = seq[:-1]
            if not head or (len(output) >= len(head) and output[len(output) - len(head):] == head):
                out.add(seq[-1])
        return sorted(out)

    @property
    def needs_last_tokens(self) -> bool:
        """Its bans depend on the output so far (a bad word of several tokens): a batch built while
        its last token is still being sampled could not tell them."""
        return any(len(seq) > 1 for seq in self.bad_words or ())

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to be computed before the next sample."""
        return len(self.tokens) - self.num_computed
