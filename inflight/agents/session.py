"""One agent episode's session: every model call it makes, recorded as the engine answered it.

`Session` is what the agent endpoint keeps per episode: its token, the run's sampling for its calls
and the `CallRecord`s. `SessionBackend` wraps the run's `InferenceClient` for the session's
requests: each call samples with the run's `generator.sampling_params` (temperature, top-p, top-k;
`max_tokens` capped by max_generate_length; a seed per call when the run has one; log-probabilities
always), stays on one engine (`session_id`: its prefix cache), and its final output is kept verbatim.
`SessionScope` is one API request of the session (`inflight.server.backend.CallScope`): its prompt
continues an earlier call's tokens when the agent sent its history back (`continuation.py`), and
when its engine calls are done each becomes a `CallRecord`: the prompt as rendered, the sampled ids
up to the stop string that ended the reply (if one did: what the client saw), their log-probabilities
and weight versions.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.agents.continuation import chat_turn, continue_chat, continue_text
from inflight.agents.records import CallRecord
from inflight.chat.stop import truncate_at_stop
from inflight.chat.turns import ChatFormat
from inflight.engine.request import RequestOutput, SamplingParams
from inflight.rollout.task_generator import request_seed
from inflight.server.backend import CallScope
from inflight.server.chat_prompt import chat_prompt, template_messages
from inflight.server.protocol import ChatCompletionRequest
from inflight.server.tools import parses_tool_calls


@dataclass(frozen=True)
class SessionSampling:
    """The run's sampling for every call of a session (`generator.sampling_params`); `seed`: the
    parts of each call's seed (the call's number is added), None for unseeded sampling."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1024
    seed: tuple[Any, ...] | None = None

    def apply(self, params: SamplingParams | None, call: int) -> SamplingParams:
        params = params or SamplingParams()
        seed = None if self.seed is None else request_seed(*self.seed, call)
        return dataclasses.replace(params, temperature=self.temperature, top_p=self.top_p,
                                   top_k=max(self.top_k, 0), logprobs=True, seed=seed,
                                   max_tokens=max(1, min(params.max_tokens, self.max_tokens)))


@dataclass
class Session:
    """An episode's model calls. `token` is its secret (the API key, and the URL's session part)."""

    id: str
    token: str
    sampling: SessionSampling
    fmt: ChatFormat
    records: list[CallRecord] = field(default_factory=list)
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    """Each engine request's last output (by request id) until its API call finishes."""
    closed: bool = False
    _calls: itertools.count = field(default_factory=itertools.count)

    def next_call(self) -> int:
        return next(self._calls)


class SessionBackend:
    """The run's client for one session's requests (a `Backend`): the run's sampling, one engine,
    and every output kept."""

    def __init__(self, client: Any, session: Session) -> None:
        self.client, self.session = client, session

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        return self.session.sampling.apply(params, self.session.next_call())

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, cache_salt: str | None = None) -> RequestOutput:
        out = await self.client.generate(prompt_token_ids, self._params(params), request_id=request_id,
                                         cache_salt=cache_salt, session_id=self.session.id)
        self.session.outputs[request_id or out.request_id] = out
        return out

    async def generate_stream(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                              request_id: str | None = None, cache_salt: str | None = None
                              ) -> AsyncIterator[RequestOutput]:
        last = None
        try:
            async for snapshot in self.client.generate_stream(prompt_token_ids, self._params(params),
                                                              request_id=request_id, cache_salt=cache_salt,
                                                              session_id=self.session.id):
                last = snapshot
                yield snapshot
        finally:  # a reply ended by a stop string stops reading before the engine finished
            if last is not None:
                self.session.outputs[request_id or last.request_id] = last


class SessionScope(CallScope):
    """One API request of a session: continued prompts, recorded calls."""

    def __init__(self, backend: SessionBackend, tokenizer: Any) -> None:
        super().__init__(backend)
        self.session, self.tokenizer = backend.session, tokenizer
        self._chat: tuple[list[dict[str, Any]], Any, ChatFormat, bool] | None = None
        self._texts: dict[tuple[int, ...], str] = {}

    def _format(self, req: ChatCompletionRequest) -> ChatFormat:
        """The run's chat template and arguments under the request's own."""
        kwargs = {**self.session.fmt.kwargs, **(req.chat_template_kwargs or {})}
        return ChatFormat(req.chat_template or self.session.fmt.template, kwargs)

    def chat_prompt(self, tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
        fmt = self._format(req)
        rendered = template_messages(req)
        self._chat = (rendered, req.tools or None, fmt, parses_tool_calls(req))
        if req.add_generation_prompt and not req.continue_final_message and not req.add_special_tokens:
            ids = continue_chat(self.session.records, tokenizer, rendered, req.tools or None, fmt)
            if ids is not None:
                return ids
        update = {"chat_template": fmt.template, "chat_template_kwargs": dict(fmt.kwargs) or None}
        return chat_prompt(tokenizer, req.model_copy(update=update))

    def text_prompt(self, tokenizer: Any, text: str) -> list[int]:
        ids = continue_text(self.session.records, tokenizer, text)
        ids = ids if ids is not None else super().text_prompt(tokenizer, text)
        self._texts[tuple(ids)] = text
        return ids

    def finished(self, calls: Sequence[Any]) -> None:
        for call in calls:
            out = self.session.outputs.pop(call.request_id, None)
            if out is None or self.session.closed:
                continue
            self.session.records.append(self._record(call, out))

    def _record(self, call: Any, out: RequestOutput) -> CallRecord:
        tracker = call.tracker
        ids, n = list(out.output_token_ids), len(out.output_token_ids)
        finish = out.finish_reason or "stop"
        if tracker.stopped and tracker.stop:  # the reply ended at a stop string: the tokens up to it
            decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=tracker.skip_special_tokens)  # noqa: E731
            match = truncate_at_stop(ids, tracker.stop, decode, True)
            n, finish = (match.num_tokens, "stop") if match is not None else (n, finish)
        chat = text = None
        if self._chat is not None:
            rendered, tools, fmt, parse = self._chat
            chat = chat_turn(rendered, tools, fmt, tracker.text, parse)
        elif tuple(call.prompt_token_ids) in self._texts:
            text = (self._texts[tuple(call.prompt_token_ids)], tracker.text)
        return CallRecord(len(self.session.records), list(call.prompt_token_ids), ids[:n],
                          list(out.logprobs or [])[:n], list(out.token_weight_versions)[:n], finish,
                          out.num_cached_tokens, out.num_recomputed_tokens, chat, text)


__all__ = ["Session", "SessionBackend", "SessionSampling", "SessionScope"]
