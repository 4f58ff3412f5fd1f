"""A session's calls as training samples: token-in/token-out trajectories, never re-tokenised.

A call whose prompt starts with a sample's tokens so far (its first prompt, then every call's sampled
ids and what came between) continues that sample: the tokens between the sample's end and the end of
the call's prompt are observations (loss mask 0, version `ENV_VERSION`, log-probability 0), then
come the call's sampled ids with their own log-probabilities and weight versions (loss mask 1). A
call that continues no sample (the agent rewrote, dropped or summarised its history, or branched
from an earlier call that another call already continued) starts a new sample: `Merged.new_samples`
counts them. Only the token ids decide; nothing is decoded or encoded here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from inflight.agents.records import CallRecord
from inflight.rollout.trajectory import ENV_VERSION


@dataclass
class Sample:
    """One token-in/token-out sequence of a session: the first call's prompt, then per-token
    responses (sampled ids and observations), aligned."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    """The indices of the calls merged into it, in order."""
    finish_reason: str = "stop"
    num_cached_tokens: int = 0
    num_recomputed_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *self.response_ids]

    def extend(self, call: CallRecord) -> None:
        """Append `call`, whose prompt starts with this sample's tokens."""
        observed = call.prompt_ids[len(self.prompt_ids) + len(self.response_ids):]
        self._append(observed, [0.0] * len(observed), [ENV_VERSION] * len(observed), 0)
        self._append(call.output_ids, call.logprobs, call.versions, 1)
        self.calls.append(call.index)
        self.finish_reason = call.finish_reason
        self.num_cached_tokens += call.num_cached_tokens
        self.num_recomputed_tokens += call.num_recomputed_tokens

    def _append(self, ids: list[int], logprobs: list[float], versions: list[int], mask: int) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.loss_mask += [mask] * len(ids)


@dataclass
class Merged:
    """A session's samples, in the order they started, and how many calls started one after the
    first (histories rewritten or branched)."""

    samples: list[Sample]
    new_samples: int


def _continues(sample: Sample, call: CallRecord) -> bool:
    """Whether `call`'s prompt holds all of `sample` and goes on after it."""
    n = len(sample.prompt_ids) + len(sample.response_ids)
    return len(call.prompt_ids) >= n and call.prompt_ids[:len(sample.prompt_ids)] == sample.prompt_ids \
        and call.prompt_ids[len(sample.prompt_ids):n] == sample.response_ids


def merge_calls(calls: Sequence[CallRecord]) -> Merged:
    """The samples of `calls` (in the order they finished); each call continues the latest sample it
    extends, else starts one."""
    samples: list[Sample] = []
    for call in calls:
        target = next((s for s in reversed(samples) if _continues(s, call)), None)
        if target is None:
            target = Sample(list(call.prompt_ids))
            samples.append(target)
        target.extend(call)
    return Merged(samples, max(0, len(samples) - 1))


__all__ = ["Merged", "Sample", "merge_calls"]
