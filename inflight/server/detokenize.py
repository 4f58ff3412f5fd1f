"""Token ids to text, incrementally: per-request text deltas for streaming, and stop strings.

`IncrementalDetokenizer` decodes only a short window of recent tokens per step (the method vLLM and
HF's TextStreamer use), holding text back while it ends in an incomplete UTF-8 sequence (U+FFFD).
`ChoiceTracker` turns successive `RequestOutput` snapshots of one request into `Delta`s, and keeps
what the whole choice needs besides them: the prompt's scores (`prompt_logprobs`), the echoed
prompt text and vLLM's `stop_reason` (the stop string or stop token id that ended it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from inflight.chat.stop import first_stop
from inflight.engine.request import RequestOutput

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of the tokens added so far, returned as deltas."""

    CONTEXT_TOKENS = 6  # prompt tail decoded with the output, so leading spaces come out right

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(REPLACEMENT)):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        return self._advance(final=False) if token_ids else ""

    def flush(self) -> str:
        """Text still held back (an incomplete character comes out as U+FFFD, as decode() does)."""
        return self._advance(final=True)


@dataclass
class Delta:
    """What one choice produced since its previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    token_weight_versions: list[int]
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when the request asked


@dataclass
class ChoiceTracker:
    """State of one choice: all tokens so far, the text handed out, stop strings."""

    index: int
    tokenizer: object
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop: bool = False  # keep the matched stop string at the end of the text (vLLM's option)
    incremental: bool = True  # False: only a final snapshot comes, decoded in one go
    decode: bool = True  # False: tokens only, no text (the token-in/token-out route)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    keep_output: bool = True  # False: the prompt alone (echo with max_tokens=0: the one token is dropped)
    prompt_text: str = ""  # the prompt as echoed (completions `echo`)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    token_weight_versions: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_recomputed_tokens: int = 0
    stopped: bool = False  # a stop string matched: the engine request is to be aborted
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id; None at EOS or length
    prompt_logprobs: list[float | None] | None = None  # the engine's prompt scores, when asked
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    routed_experts: np.ndarray | None = None  # an MoE model's routing record (the finished snapshot's)
    routed_experts_start: int = 0

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, self.skip_special_tokens)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._decoded = ""

    def update(self, snapshot: RequestOutput) -> Delta:
        if self.finish_reason is not None:  # already stopped by a stop string
            return Delta(self.index, "", [], None, [], None)
        if snapshot.prompt_logprobs is not None:
            self.prompt_logprobs = snapshot.prompt_logprobs
            self.prompt_top_logprobs = snapshot.prompt_top_logprobs
            self.prompt_logprob_ranks = snapshot.prompt_logprob_ranks
        if snapshot.routed_experts is not None:
            self.routed_experts, self.routed_experts_start = (
                snapshot.routed_experts,
                snapshot.routed_experts_start,
            )
        start = len(self.output_token_ids)
        end = len(snapshot.output_token_ids) if self.keep_output else start
        new_ids = snapshot.output_token_ids[start:end]
        new_logprobs = snapshot.logprobs[start:end] if snapshot.logprobs is not None else None
        new_top = snapshot.top_logprobs[start:end] if snapshot.top_logprobs is not None else None
        new_versions = snapshot.token_weight_versions[start:end]
        self.output_token_ids.extend(new_ids)
        if new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + new_logprobs
        if new_top is not None:
            self.top_logprobs = (self.top_logprobs or []) + new_top
        self.token_weight_versions.extend(new_versions)
        self.num_cached_tokens = snapshot.num_cached_tokens
        self.num_recomputed_tokens = snapshot.num_recomputed_tokens
        if not self.decode:
            delta = ""
        elif self.incremental:
            delta = self._detok.add(new_ids) + (self._detok.flush() if snapshot.finished else "")
        else:  # decode everything again (meant for one final snapshot); the delta is the new suffix
            full = self.tokenizer.decode(self.output_token_ids, skip_special_tokens=self.skip_special_tokens)
            delta, self._decoded = full[len(self._decoded) :], full
        searched = max(0, len(self.text) - self._hold)
        self.text += delta
        if self.stop:
            hit = first_stop(self.text, self.stop, searched)  # the rule training uses (inflight.chat.stop)
            if hit is not None:
                at, matched = hit
                self.text = self.text[: at + (len(matched) if self.include_stop else 0)]
                self.finish_reason, self.stopped, self.stop_reason = "stop", True, matched
        if self.finish_reason is None and snapshot.finished:
            self.finish_reason = snapshot.finish_reason
            self.stop_reason = self._stop_token(snapshot)
        upto = (
            len(self.text)
            if self.finish_reason is not None
            else max(self.emitted, len(self.text) - self._hold)
        )
        text, self.emitted = self.text[self.emitted : upto], upto
        return Delta(self.index, text, new_ids, new_logprobs, new_versions, self.finish_reason, new_top)

    def _stop_token(self, snapshot: RequestOutput) -> int | None:
        """The stop token id that ended the request (vLLM's `stop_reason`); None at EOS, length or abort."""
        if snapshot.finish_reason != "stop" or not snapshot.output_token_ids:
            return None
        last = snapshot.output_token_ids[-1]
        at_eos = not self.ignore_eos and last == getattr(self.tokenizer, "eos_token_id", None)
        return last if last in self.stop_token_ids and not at_eos else None

    @property
    def prompt_scores_complete(self) -> bool:
        """Whether every prompt token has its score (or none were asked for)."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == len(self.prompt_token_ids)
