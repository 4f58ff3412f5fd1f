"""Requests, their sampling parameters and their outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.engine.errors import InvalidRequestError
from inflight.engine.multimodal import ImagePlan

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily: dividing logits by them overflows float32 (vLLM draws
the same line). Their log-probabilities are then of the unscaled distribution, as for 0."""


def scaling_temperature(temperature: float) -> float:
    """What logits are divided by for `temperature`: itself, or 1 where it samples greedily."""
    return 1.0 if temperature < GREEDY_BELOW else float(temperature)


@dataclass
class SamplingParams:
    """How to sample one request.

    `temperature=0` (or anything below `GREEDY_BELOW`) is greedy. `top_k=0` (or -1) and `top_p=1` disable
    those filters. `seed` makes the request's samples reproducible whatever else is in the batch. `logprobs`
    records, for each sampled token, its log-probability under the temperature-scaled distribution (before
    top-k/top-p), which is what a policy-gradient trainer recomputes. `top_logprobs=k` also records, for each
    sampled token, the k most likely tokens of that same distribution with their log-probabilities (OpenAI's
    `top_logprobs`, vLLM's integer `logprobs`); it needs `logprobs=True`, and only requests that ask pay for
    it. `prompt_logprobs` (vLLM's name) scores the prompt during prefill: None = off, 0 = each prompt token's
    own log-probability, k = also the k most likely tokens at that position; of the model's distribution (no
    temperature: nothing is sampled there); the first prompt token has none. Such a request reads nothing from
    the prefix cache while its prompt is unscored (cached KV has no logits), and only requests that ask pay
    for it. `return_routed_experts` (mixture-of-experts models only) returns the routing of every prompt
    position too, not only of the positions that sampled a token (`RequestOutput.routed_experts`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = True
    top_logprobs: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    return_routed_experts: bool = False

    def validate(self) -> None:
        """Raise InvalidRequestError naming every invalid field."""
        problems = []
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not (self.temperature >= 0.0):
            problems.append(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k={self.top_k!r} must be an integer >= 0 (0 or -1 disables it)")
        if (
            not isinstance(self.top_logprobs, int)
            or isinstance(self.top_logprobs, bool)
            or self.top_logprobs < 0
        ):
            problems.append(f"top_logprobs={self.top_logprobs!r} must be an integer >= 0 (0: none)")
        elif self.top_logprobs > 0 and not self.logprobs:
            problems.append(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or self.prompt_logprobs < 0
        ):
            problems.append(f"prompt_logprobs={self.prompt_logprobs!r} must be None (off) or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed={self.seed!r} must be an integer or None")
        if not isinstance(self.return_routed_experts, bool):
            problems.append(f"return_routed_experts={self.return_routed_experts!r} must be true or false")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        if problems:
            raise InvalidRequestError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class RequestStatus(enum.Enum):
    """Where a request is: queued (`waiting`, also after a preemption), scheduled with KV blocks
    (`running`) or done (`finished`)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """The result of one request: its tokens, their logprobs and the weight version that sampled each.

    `top_logprobs` (when the request asked for k > 0) holds, per output token, the k most likely
    `(token_id, logprob)` pairs of the distribution it was sampled from, most likely first.
    `prompt_logprobs` (when the request set `prompt_logprobs`) holds, per prompt token scored so far,
    its log-probability given the tokens before it (None for the first), and `prompt_top_logprobs`
    (k > 0) the k most likely `(token_id, logprob)` pairs at that position (None for the first);
    `prompt_logprob_ranks` each prompt token's rank there (1 = most likely; None for the first).
    `routed_experts` (mixture-of-experts models, finished requests; None otherwise) is the routing
    record [positions, MoE layers, top_k] (uint8, or uint16 above 256 experts): row i holds the
    experts each MoE layer chose for position `routed_experts_start + i` of prompt + output, in the
    forward whose KV the request attends to (`inflight.engine.routing`). It covers the positions up
    to the last one with KV, i.e. all but the last sampled token, from the last prompt position
    (`routed_experts_start` = prompt length - 1: one row per sampled token, from the forward that
    sampled it) or, with `SamplingParams.return_routed_experts`, from position 0. A request aborted
    before its KV was computed again (a reset while paused) has fewer rows.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float] | None
    token_weight_versions: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while unfinished
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """A request's mutable state inside the engine (tokens so far, KV blocks, progress)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: int,
        cache_salt: str | None = None,
        images: ImagePlan | None = None,
    ) -> None:
        self.request_id = request_id
        self.images = images  # the prompt's images (vision-language models), planned at admission
        self.params = params
        self.cache_salt = cache_salt
        self.arrival = arrival
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.logprobs: list[float | None] = []  # None where params.logprobs is off (not computed)
        self.top_logprobs: list[list[tuple[int, float]]] = []  # only filled when params.top_logprobs > 0
        # params.prompt_logprobs set: per prompt token scored so far (the first has none)
        self.prompt_logprobs: list[float | None] = [None]
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = [None]
        self.prompt_logprob_ranks: list[int | None] = [None]
        self.token_weight_versions: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks registered so far
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.max_computed_tokens = 0  # high-water mark, to count recomputation
        self.num_cached_tokens = 0  # tokens served by the prefix cache at admission
        self.num_recomputed_tokens = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens asked to be scored are still unscored (their logits are to come)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, logprobs: list[float], ranks: list[int],
                            tops: list[list[tuple[int, float]]] | None) -> None:
        """Record the scores of the next prompt tokens, in order."""
        self.prompt_logprobs.extend(logprobs)
        self.prompt_logprob_ranks.extend(ranks)
        if tops is not None:
            self.prompt_top_logprobs.extend(tops)

    def append_token(
        self, token_id: int, logprob: float | None, weight_version: int,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.token_weight_versions.append(weight_version)
        if top_logprobs is not None:
            self.top_logprobs.append(top_logprobs)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            logprobs=list(self.logprobs) if self.params.logprobs else None,
            token_weight_versions=list(self.token_weight_versions),
            finish_reason=self.finish_reason,
            num_recomputed_tokens=self.num_recomputed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            top_logprobs=list(self.top_logprobs) if self.params.top_logprobs > 0 else None,
            prompt_logprobs=list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None,
            prompt_top_logprobs=list(self.prompt_top_logprobs) if self.params.prompt_logprobs else None,
            prompt_logprob_ranks=list(self.prompt_logprob_ranks)
            if self.params.prompt_logprobs is not None
            else None,
        )
