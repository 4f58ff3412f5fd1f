"""InferenceClient: what a trainer needs from its inference engines, written once as operations.

Each engine operation is declared once, here, with `@op`: its signature (the protocol), how every
engine's answer becomes one (`combine`, the fan-out's rule) and how it travels over HTTP (`http`:
method, route, query parameters of its arguments, whether it may be retried, the answer). A client
subclassing `InferenceClient` gets every operation as one `self._call(name, *args)`, so a client is
only how an operation travels: `LocalClient` (in process), `ProcessClient` / `RayEngineClient`
(another process), `HttpClient` (one server), `FanOutClient` / `RemoteClient` (every engine). The
engine side is `inflight.client.ops.apply_op` (the method of the same name on an AsyncEngine) or,
over HTTP, the server's route. A new operation: its `@op` here, its engine method, its route.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from inflight.client import wire
from inflight.client.errors import InconsistentServersError
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import RequestOutput, SamplingParams

Combine = Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class HttpRoute:
    """How an operation travels over HTTP: `params` turns its arguments into the query string;
    `answer` reads its result from the response (None: no result)."""

    method: str
    path: str
    params: Callable[..., dict[str, Any] | None] | None = None
    idempotent: bool = True
    answer: Callable[[Any], Any] | None = None
    allow: tuple[int, ...] = ()  # error statuses that are answers (e.g. 409: the cache is not empty)


@dataclass(frozen=True)
class Op:
    """One engine operation: how the engines' answers combine, and how it travels over HTTP."""

    name: str
    combine: Combine
    http: HttpRoute | None


OPS: dict[str, Op] = {}
"""Every engine operation by name (generation goes to one engine, the others to every engine)."""


def op(combine: Combine, http: HttpRoute | None = None) -> Callable[[Callable], Callable]:
    """Declare the decorated protocol method an operation: calling it is `self._call(name, *args)`
    with every argument in signature order (defaults filled in)."""

    def declare(stub: Callable) -> Callable:
        name, signature = stub.__name__, inspect.signature(stub)
        OPS[name] = Op(name, combine, http)

        @functools.wraps(stub)
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            return await self._call(name, *list(bound.arguments.values())[1:])

        return call

    return declare


def _nothing(answers: dict[str, Any]) -> None:
    return None


def _every(answers: dict[str, Any]) -> bool:
    return all(bool(a) for a in answers.values())


def _one_version(problem: str) -> Combine:
    def combine(answers: dict[str, Any]) -> int:
        values = {n: int(v) for n, v in answers.items()}
        if len(set(values.values())) != 1:
            raise InconsistentServersError(f"engines {problem}: {values}")
        return next(iter(values.values()))

    return combine


def _summed(answers: dict[str, Any]) -> dict[str, int]:
    total: dict[str, int] = {}
    for counters in answers.values():
        for key, value in counters.items():
            total[key] = total.get(key, 0) + value
    return total


def _flag(value: bool) -> str:
    return str(bool(value)).lower()


def _reset_answer(response: Any) -> bool:
    body = wire.response_body(response)
    if not isinstance(body, dict) or "success" not in body:
        raise InconsistentServersError(f"reset_prefix_cache answers without 'success': {body}")
    return bool(body["success"])


def _version_answer(response: Any) -> int:
    return int(response.json()["weight_version"])


@runtime_checkable
class InferenceClient(Protocol):
    """Generation plus the weight-sync lifecycle (docs/design.md section 5), as coroutines. Every
    client raises the engine's error classes (InvalidRequestError, EngineStateError,
    WeightUpdateError) for the same mistakes."""

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
        multimodal: MultimodalInput | None = None,
    ) -> RequestOutput:
        """Generate to completion; blocks across a KEEP pause and weight update. `session_id` keeps
        a multi-turn trajectory on one server (prefix cache); ignored in process. `multimodal`: the
        prompt's images, whose placeholder tokens it holds (a vision-language model's engine)."""
        return await self._call("generate", list(prompt_token_ids), params, request_id, cache_salt,  # type: ignore[attr-defined]
                                multimodal)

    async def generate_stream(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                              request_id: str | None = None, cache_salt: str | None = None,
                              session_id: str | None = None, multimodal: MultimodalInput | None = None
                              ) -> AsyncIterator[RequestOutput]:
        """Snapshots of a generation, the last one finished (what a server route streams from). A
        client that cannot stream (every one but `LocalClient`) yields the final output alone."""
        yield await self.generate(prompt_token_ids, params, request_id=request_id, cache_salt=cache_salt,
                                  session_id=session_id, multimodal=multimodal)

    @op(_nothing, HttpRoute("POST", wire.PAUSE, lambda mode: {"mode": mode}))
    async def pause(self, mode: str = "keep") -> None:
        """Pause generation on every engine: `abort` finishes in-flight requests now, `keep` freezes
        them with their KV, `wait` lets them finish first. Blocked `generate` calls wait across it."""

    @op(_nothing, HttpRoute("POST", wire.RESUME))
    async def resume(self) -> None:
        """Undo any pause on every engine; frozen requests continue."""

    @op(_nothing, HttpRoute("POST", wire.SLEEP, lambda offload_kv: {"offload_kv": _flag(offload_kv)}))
    async def sleep(self, offload_kv: bool = False) -> None:
        """Free both memory pools of every engine: the weights are dropped (a full update must
        follow), the KV cache is copied to host memory (`offload_kv`) or discarded."""

    @op(
        _nothing, HttpRoute("POST", wire.WAKE_UP, lambda tags: None if tags is None else {"tags": list(tags)})
    )
    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the named pools (`weights`, `kv_cache`; None: both) at the same block ids."""

    @op(_every, HttpRoute("POST", wire.RESET_PREFIX_CACHE,
                          lambda running: {"reset_running_requests": _flag(running)},
                          answer=_reset_answer, allow=(409,)))  # fmt: skip
    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """True iff every engine's prefix cache is now empty."""
        ...

    @op(_nothing, HttpRoute("POST", wire.WEIGHTS_BEGIN))
    async def begin_weight_update(self) -> None:
        """Open a weight update on every engine; nothing is generated until it finishes or aborts."""

    @op(_nothing)  # over HTTP: safetensors chunks in request bodies (HttpClient.load_weights)
    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send a chunk of `(hf_name, tensor)` pairs to every engine's open update."""

    @op(
        _one_version("finished the update at different versions"),
        HttpRoute(
            "POST",
            wire.WEIGHTS_FINISH,
            lambda v: None if v is None else {"version": v},
            False,
            _version_answer,
        ),
    )
    async def finish_weight_update(self, version: int | None = None) -> int:
        """Complete the update (every parameter loaded) at `version` (default: the next one) on
        every engine; returns the version, which every engine must agree on."""

    @op(_every, HttpRoute("POST", wire.WEIGHTS_ABORT, None, False, lambda r: bool(r.json()["restored"])))
    async def abort_weight_update(self) -> bool:
        """Abandon an update; True iff every engine is back on its pre-update weights."""
        ...

    @op(
        _one_version("are at different weight versions"),
        HttpRoute("GET", wire.WEIGHT_VERSION, answer=_version_answer),
    )
    async def weight_version(self) -> int:
        """The engines' weight version (they must all be at the same one)."""

    @op(lambda answers: answers, HttpRoute("GET", wire.STATUS, answer=lambda r: r.json()))
    async def status(self) -> dict[str, Any]:
        """The engine's lifecycle state, queues and step loop (`AsyncEngine.status().to_dict()`); a
        FanOutClient (or RemoteClient) answers each engine's by name (URL)."""
        ...

    @op(_summed)  # a server reports none over HTTP: {}
    async def stats(self) -> dict[str, int]:
        """The engines' counters (`EngineStats.as_dict()`, summed over engines); {} when the engines
        do not report them (an HTTP server)."""
        ...

    async def init_weight_transfer(self, master_address: str = "127.0.0.1", master_port: int = 0, *,
                                   backend: str | None = None, group_name: str = wire.DEFAULT_WEIGHT_GROUP,
                                   device: str | torch.device = "cpu", max_chunk_bytes: int | None = None,
                                   dtype: torch.dtype | None = None, timeout_s: float = 600.0,
                                   override_existing: bool = True) -> dict[str, Any]:
        """Form a weight broadcast group: this process is rank 0 (hosting the rendezvous at
        master_address:master_port, 0 for a free port), every engine joins at ranks 1..N. Returns
        the group's description. In process there is nothing to join."""
        ...

    async def update_weights_broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                       version: int | None = None) -> int:
        """begin → the chunks over the broadcast group → finish, all or nothing: on any failure the update is
        aborted (the engines go back to their old weights where they can) and the error re-raised."""
        ...

    async def close_weight_transfer(self) -> None:
        """Leave the broadcast group (every engine and this process)."""
        ...

    async def close(self) -> None:
        """Release what the client holds (connections, processes it started)."""


async def update_weights(client: InferenceClient, named_tensors: Iterable[tuple[str, torch.Tensor]],
                         version: int | None = None) -> int:
    """begin → load_weights → finish on any client; returns the new weight version."""
    await client.begin_weight_update()
    await client.load_weights(named_tensors)
    return await client.finish_weight_update(version)
