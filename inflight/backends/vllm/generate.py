"""The token route `POST /inflight/v1/generate` over vLLM's `AsyncLLM`, with our semantics.

- A request blocks across a keep pause and returns one normal result: the shim submits it to vLLM
  only while the engine can run (`Lifecycle.can_run`), and vLLM's keep pause freezes it in place.
- Per-token weight versions come from vLLM's own spans (`CompletionOutput.weight_versions`): vLLM's
  engine core labels each step's outputs with its weight version, which the shim sets
  (`update_weight_version`) only while the scheduler is paused, between the reload and the resume.
  A token is therefore labelled by the weights that sampled it, exactly.
- The prefix cache is salted with the weight version (`cache_salt` = `inflight-v<version>` plus the
  request's own salt). A request that vLLM has accepted but not yet started when an update lands
  would carry the old version's salt into the new weights: the update restarts it (aborted in vLLM,
  submitted again under the new salt; the caller sees one result), so no request that starts after
  an update ever reuses KV of older weights.
- `prompt_logprobs` are vLLM's (the model's own distribution, no temperature, as ours; vLLM too
  reads no prefix cache for such a request).
- Logprobs are vLLM's, in the server's `--logprobs-mode` (`processed_logprobs` unless vLLM's own flag
  says otherwise): a request with logprobs that this mode does not answer as ours (the sampled
  token under the temperature-scaled distribution before top-k/top-p, the unscaled one for greedy)
  is refused (400) naming the mode that would, never answered with different numbers
  (`logprob_modes.py`: processed answers without a filter, raw at temperature 1 or 0).

vLLM is imported lazily, so the request model can be read by the project's tests without vLLM.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError
from .logprob_modes import DEFAULT, refusal, serves
from .state import Lifecycle

# vLLM hands the shim a request's new tokens every STREAM_INTERVAL tokens (and always its first):
# an output per step keeps the event loop busy when the engine outpaces the frontend (seen with
# the tiny test model: a pause request then waited until generation ended); the first token is
# what `restart_unstarted` needs to know.
STREAM_INTERVAL = 32


class SamplingFields(BaseModel):
    """`inflight.engine.request.SamplingParams` as JSON (the same fields and defaults; a test holds
    them equal). Unknown fields are an error: this API is ours."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: bool = True
    top_logprobs: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    return_routed_experts: bool = False
    prompt_logprobs: int | None = None


class GenerateBody(BaseModel):
    """Body of `/inflight/v1/generate` (as the native server's `GenerateRequest`)."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int]
    sampling_params: SamplingFields = Field(default_factory=SamplingFields)
    request_id: str | None = None
    cache_salt: str | None = None
    model: str | None = None


def check_sampling(p: SamplingFields, logprobs_mode: str = DEFAULT) -> None:
    """400 naming every invalid field (the engine's rules, plus what vLLM in `logprobs_mode` cannot
    give as ours)."""
    problems = []
    if p.max_tokens < 1:
        problems.append(f"max_tokens={p.max_tokens} must be an integer >= 1")
    if not p.temperature >= 0.0:
        problems.append(f"temperature={p.temperature} must be a number >= 0 (0 means greedy)")
    if not 0.0 < p.top_p <= 1.0:
        problems.append(f"top_p={p.top_p} must be in (0, 1]")
    if p.top_k < -1:
        problems.append(f"top_k={p.top_k} must be an integer >= 0 (0 or -1 disables it)")
    if p.top_logprobs < 0:
        problems.append(f"top_logprobs={p.top_logprobs} must be an integer >= 0 (0: none)")
    elif p.top_logprobs > 0 and not p.logprobs:
        problems.append(f"top_logprobs={p.top_logprobs} needs logprobs=True")
    if p.prompt_logprobs is not None and p.prompt_logprobs < 0:
        problems.append(f"prompt_logprobs={p.prompt_logprobs} must be None (off) or an integer >= 0")
    if any(t < 0 for t in p.stop_token_ids):
        problems.append(f"stop_token_ids={p.stop_token_ids} must be non-negative integers")
    if p.logprobs and not problems and not serves(logprobs_mode, p.temperature, p.top_p, p.top_k):
        problems.append(refusal(logprobs_mode, p.temperature, p.top_p, p.top_k))
    if p.return_routed_experts:
        problems.append(
            "return_routed_experts=True: the vLLM backend does not return the routing of "
            "mixture-of-experts models (vLLM 0.32 records it only in its Model Runner V2, "
            "VLLM_USE_V2_MODEL_RUNNER=1, which needs Triton: not on CPU; and this server does not "
            "pass it on yet); use the native backend for routing records"
        )
    if problems:
        first = problems[0].split("=", 1)[0]
        raise APIError(400, "invalid sampling parameters: " + "; ".join(problems), code="invalid_value",
                       param=first)


def vllm_sampling(p: SamplingFields) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0),
        seed=p.seed, logprobs=p.top_logprobs if p.logprobs else None, stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, prompt_logprobs=p.prompt_logprobs, detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=STREAM_INTERVAL,
    )


def salt_for(version: int, salt: str | None) -> str:
    """The prefix-cache salt of a request at `version` (vLLM forbids '@', '/', '\\' in salts)."""
    return f"inflight-v{version}" + (f".{salt}" if salt else "")


@dataclass
class Live:
    """A token-route request in flight: what the shim knows of it."""

    request_id: str
    attempt: int = 0
    salt_version: int = 0
    num_outputs: int = 0  # output tokens streamed so far
    restart: bool = False  # set by an update: accepted, never started, carries an old salt
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[list[float]]] = field(default_factory=list)
    # vLLM's prompt logprobs, per prompt position: a DELTA stream hands each position over once (all of
    # them with the first output after prefill), later outputs carry an empty list
    prompt_scores: list[Any] = field(default_factory=list)

    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def vllm_id(self) -> str:
        """vLLM's id of the current attempt: unique even when a caller reuses its request ids."""
        return f"{self.request_id}#{self.nonce}.{self.attempt}"


def versions_from_spans(spans: Any, num_tokens: int) -> list[int]:
    """vLLM's weight-version spans ([start, end) per version label) as one version per token."""
    out = [-1] * num_tokens
    for span in spans or []:
        for i in range(span.start, min(span.end, num_tokens)):
            out[i] = int(span.version)
    if -1 in out:
        raise RuntimeError(f"vLLM reported no weight version for some output tokens: spans {spans}")
    return out


async def run_request(life: Lifecycle, body: GenerateBody, max_model_len: int,
                      logprobs_mode: str = DEFAULT) -> dict[str, Any]:
    """Run one request to completion across pauses and updates; our token route's answer."""
    from vllm.inputs import TokensPrompt

    p = body.sampling_params
    check_sampling(p, logprobs_mode)
    if not body.prompt_token_ids:
        raise APIError(400, "prompt_token_ids is empty", param="prompt_token_ids", code="invalid_value")
    if len(body.prompt_token_ids) + p.max_tokens > max_model_len:
        raise APIError(400, f"prompt ({len(body.prompt_token_ids)} tokens) + max_tokens ({p.max_tokens}) "
                       f"exceeds max_model_len={max_model_len}", param="max_tokens", code="invalid_value")
    live = Live(body.request_id or f"gen-{uuid.uuid4().hex}")
    if live.request_id in life.live:
        raise APIError(400, f"request_id {live.request_id!r} is already in flight", param="request_id")
    life.live[live.request_id] = live
    try:
        while True:
            await life.running.wait()  # never submitted while an update or sleep is in progress
            live.salt_version = life.weight_version
            prompt = TokensPrompt(prompt_token_ids=list(body.prompt_token_ids),
                                  cache_salt=salt_for(live.salt_version, body.cache_salt))
            final = None
            try:
                async for out in life.engine.generate(prompt, vllm_sampling(p), live.vllm_id):
                    _take(live, out, p)
                    final = out
            except ValueError as err:  # vLLM's input checks (VLLMValidationError is one)
                raise APIError(400, f"vLLM refused the request: {err}", code="invalid_value") from err
            if live.restart:  # an update restarted it (aborted in vLLM): again, under the new salt
                live.restart, live.attempt = False, live.attempt + 1
                live.tokens, live.logprobs, live.top, live.prompt_scores, live.num_outputs = [], [], [], [], 0
                continue
            if final is None or not final.finished:
                raise RuntimeError(f"vLLM ended request {live.vllm_id} without a final output")
            return _answer(live, final, p)
    finally:
        life.live.pop(live.request_id, None)


def _take(live: Live, out: Any, p: SamplingFields) -> None:
    completion = out.outputs[0]
    new = list(completion.token_ids)
    live.tokens.extend(new)
    live.num_outputs += len(new)
    live.prompt_scores.extend(out.prompt_logprobs or ())
    if p.logprobs and completion.logprobs:
        for token, position in zip(new, completion.logprobs, strict=True):
            live.logprobs.append(float(position[token].logprob))
            if p.top_logprobs:
                ranked = sorted(
                    (lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank <= p.top_logprobs
                )
                live.top.append([[t, float(lp)] for _, t, lp in ranked[: p.top_logprobs]])


def _answer(live: Live, final: Any, p: SamplingFields) -> dict[str, Any]:
    completion = final.outputs[0]
    reason = completion.finish_reason
    return {
        "request_id": live.request_id,
        "output_token_ids": live.tokens,
        "logprobs": live.logprobs if p.logprobs else None,
        "token_weight_versions": versions_from_spans(completion.weight_versions, len(live.tokens)),
        "finish_reason": reason if reason in ("stop", "length", "abort") else "stop",
        "num_cached_tokens": int(final.num_cached_tokens or 0),
        "num_recomputed_tokens": 0,
        "top_logprobs": live.top if p.top_logprobs else None,
        **prompt_scores(final.prompt_token_ids, live.prompt_scores, p.prompt_logprobs),
    }


def prompt_scores(prompt: list[int] | None, scores: Any, k: int | None) -> dict[str, Any]:
    """vLLM's prompt logprobs (per position None or {token_id: Logprob}) as the native token route
    gives them: each prompt token's logprob and rank, and the k most likely (token_id, logprob)."""
    if k is None or scores is None or prompt is None:
        return {"prompt_logprobs": None, "prompt_top_logprobs": None, "prompt_logprob_ranks": None}
    if len(scores) != len(prompt):  # a server fault (500), never the caller's
        raise RuntimeError(
            f"vLLM returned prompt logprobs for {len(scores)} of {len(prompt)} prompt positions"
        )
    logprobs, ranks, tops = [], [], []
    for token, position in zip(prompt, scores, strict=True):
        if position is None:
            logprobs.append(None)
            ranks.append(None)
            tops.append(None)
            continue
        logprobs.append(float(position[token].logprob))
        ranks.append(int(position[token].rank))
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank <= k)
        tops.append([[t, float(lp)] for _, t, lp in ranked[:k]])
    return {
        "prompt_logprobs": logprobs,
        "prompt_top_logprobs": tops if k else None,
        "prompt_logprob_ranks": ranks,
    }


async def restart_unstarted(life: Lifecycle, new_version: int) -> int:
    """Before an update's resume: abort in vLLM every live request that has produced nothing under
    an older salt (run_request submits it again under the new one). Returns how many."""
    stale = [lv for lv in life.live.values() if isinstance(lv, Live) and lv.num_outputs == 0
             and lv.salt_version < new_version]
    for lv in stale:
        lv.restart = True
    if stale:
        await life.engine.abort([lv.vllm_id for lv in stale])
        await asyncio.sleep(0)
    return len(stale)
