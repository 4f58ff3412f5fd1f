"""RemoteClient: the InferenceClient protocol over HTTP, spanning one or more inference servers.

A `FanOutClient` over one `HttpClient` per server: generation goes to one server chosen by the
Router (least outstanding requests, session affinity); every other operation goes to every server
concurrently and raises if any server fails. `HttpClient` sends each operation by its `HttpRoute`
(`inflight.client.base`). Transport errors are retried with exponential backoff for
idempotent calls. A generation request goes to another server when this one provably never got
it (connection refused); when the connection broke after it went out, it is sent again, once, to
the same server if that server still answers /health and the request has no caller-chosen id (both
servers abort a request whose client went away, so nothing is generated twice; a chosen id could
still be held by the aborting request). A server that died mid-request fails that probe, which
surfaces as `ServerUnavailableError`; one that hangs without closing is caught by polling its
/health while the request waits. Weight updates can also carry their bytes over a
broadcast group this client hosts (`init_weight_transfer`, `update_weights_broadcast`; see
`inflight.client.group`): each server joins it through its init route.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpx
import torch

from inflight.client import wire
from inflight.client.base import OPS, InferenceClient
from inflight.client.errors import ServerUnavailableError, error_from_response
from inflight.client.fanout import FanOutClient
from inflight.client.router import Router
from inflight.engine.multimodal import MultimodalInput
from inflight.engine.request import RequestOutput, SamplingParams
from inflight.engine.routing import decode_routed_experts

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# idle pooled connections are dropped before the servers' own idle timeout (uvicorn's 5 s, which
# both servers use) can close one just as a request goes out on it (the request then fails after it
# was sent, and costs a /health probe and a second send)
KEEPALIVE_EXPIRY_S = 2.0
log = logging.getLogger(__name__)


def _top_logprobs(value: list[list[list[Any]] | None] | None) -> list[list[tuple[int, float]] | None] | None:
    """The token route's `top_logprobs` or `prompt_top_logprobs` (JSON arrays; a prompt's first
    position has None) as RequestOutput holds them: (id, logprob) pairs."""
    if value is None:
        return None
    return [None if alts is None else [(int(t), float(lp)) for t, lp in alts] for alts in value]


class HttpClient(InferenceClient):
    """One server's InferenceClient operations over its HTTP API (each `OPS` entry's route)."""

    def __init__(self, url: str, http: RemoteClient) -> None:
        self.url, self.http = url, http  # the RemoteClient's pools, settings and probes

    async def send(self, method: str, path: str, *, idempotent: bool, allow: tuple[int, ...] = (),
                   retries: int | None = None, pool: str = "control", **kwargs: Any) -> httpx.Response:
        """One HTTP call; transport errors retried (backoff) when idempotent or provably not sent."""
        retries = self.http.retries if retries is None else retries
        generate = pool == "generate"
        headers = {
            **(self.http.api_headers if generate else self.http.control_headers),
            **kwargs.pop("headers", {}),
        }
        timeout = self.http.generate_timeout if generate else self.http.control_timeout
        attempt = 0
        while True:
            try:
                response = await self.http.pool(pool).request(method, self.url + path, headers=headers,
                                                              timeout=timeout, **kwargs)
            except httpx.TransportError as err:
                not_sent = isinstance(err, _NOT_SENT)
                if attempt >= retries or not (idempotent or not_sent):
                    what = "could not connect" if not_sent else "the connection failed mid-request"
                    raise ServerUnavailableError(self.url, f"{method} {path}: {what} ({type(err).__name__}: "
                                                 f"{err or 'no detail'}) after {attempt + 1} attempt(s)",
                                                 request_sent=not not_sent) from err
                await asyncio.sleep(self.http.backoff_s * 2**attempt)
                attempt += 1
                continue
            if response.status_code >= 400 and response.status_code not in allow:
                raise error_from_response(self.url, response.status_code, wire.response_body(response))
            return response

    async def _call(self, op: str, *args: Any) -> Any:
        route = OPS[op].http
        assert route is not None, f"{op} has no HTTP route"
        query = route.params(*args) if route.params is not None else None
        response = await self.send(route.method, route.path, idempotent=route.idempotent, params=query,
                                   allow=route.allow)
        return route.answer(response) if route.answer is not None else None

    async def stats(self) -> dict[str, int]:
        """A server reports no engine counters over HTTP (see /metrics)."""
        return {}

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tensors (HF names) in safetensors chunks of `chunk_bytes`, one request each."""
        await self.http.send_chunks(named_tensors, self.load_chunk)

    async def load_chunk(self, data: bytes | str) -> None:
        """One safetensors buffer of HF-named tensors to the chunk route: the bytes, or the name of
        the chunk file holding them (`wire.write_chunk_file`, a server on this host)."""
        if isinstance(data, str):
            await self.send("POST", wire.WEIGHTS_CHUNK, idempotent=True, params={wire.CHUNK_FILE_PARAM: data})
            return
        await self.send("POST", wire.WEIGHTS_CHUNK, idempotent=True, content=data,
                        headers={"Content-Type": wire.CONTENT_TYPE})

    async def join_weight_group(self, request: dict[str, Any]) -> dict[str, Any]:
        return (await self.send("POST", wire.INIT_WEIGHT_TRANSFER, idempotent=False, json=request)).json()

    async def receive_weight_chunk(self, metadata: dict[str, Any]) -> int:
        response = await self.send("POST", wire.WEIGHTS_BROADCAST, idempotent=False, json=metadata)
        return int(response.json()["num_tensors"])

    async def leave_weight_group(self) -> bool:
        return (await self.send("POST", wire.DESTROY_WEIGHT_TRANSFER, idempotent=True)).json()["destroyed"]

    async def health(self) -> dict[str, Any]:
        return (await self.send("GET", wire.HEALTH, idempotent=True)).json()

    # ---- generation ---------------------------------------------------------------------------
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
        """Generate on this server; sent again once when the connection broke after it went out
        and the server still answers /health (see the module docstring)."""
        prompt = list(prompt_token_ids)
        body: dict[str, Any] = {
            "prompt_token_ids": prompt,
            "sampling_params": dataclasses.asdict(params or SamplingParams()),
        }
        if request_id is not None:
            body["request_id"] = request_id
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if multimodal is not None:
            body["multimodal"] = wire.encode_images(multimodal)
        try:
            data = await self._generate_once(body)
        except ServerUnavailableError as err:
            lost = err.request_sent and isinstance(err.__cause__, httpx.TransportError)
            if not lost or request_id is not None or not await self._answers_health():
                raise
            log.warning(
                "%s: a generation request's connection broke after it was sent (%s); the server "
                "answers /health, so it is sent once more",
                self.url,
                err.__cause__.__class__.__name__,
            )
            data = await self._generate_once(body)
        routed_experts, routed_start = decode_routed_experts(data.get("routed_experts"))
        return RequestOutput(
            request_id=data["request_id"], prompt_token_ids=prompt, output_token_ids=data["output_token_ids"],
            logprobs=data.get("logprobs"), token_weight_versions=data["token_weight_versions"],
            finish_reason=data["finish_reason"], num_recomputed_tokens=data.get("num_recomputed_tokens", 0),
            num_cached_tokens=data.get("num_cached_tokens", 0),
            top_logprobs=_top_logprobs(data.get("top_logprobs")),
            routed_experts=routed_experts, routed_experts_start=routed_start,
            prompt_logprobs=data.get("prompt_logprobs"),
            prompt_logprob_ranks=data.get("prompt_logprob_ranks"),
            prompt_top_logprobs=_top_logprobs(data.get("prompt_top_logprobs")),
        )  # fmt: skip

    async def _answers_health(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers /health now (a probe of its own: no cached answer)."""
        try:
            return (await self.http.pool().get(self.url + wire.HEALTH, timeout=timeout_s)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _generate_once(self, body: dict[str, Any]) -> dict[str, Any]:
        call = asyncio.ensure_future(self.send("POST", wire.GENERATE, idempotent=False, retries=0,
                                               pool="generate", json=body))
        call.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "never retrieved"
        try:
            return (await self._watch(call)).json()
        finally:
            if not call.done():
                call.cancel()  # closing the connection makes the server abort the request

    async def _watch(self, call: asyncio.Future[httpx.Response]) -> httpx.Response:
        """Wait for `call`; give up if the server stops answering /health twice in a row."""
        if self.http.health_check_interval_s is None:
            return await call
        misses = 0
        while True:
            done, _ = await asyncio.wait({call}, timeout=self.http.health_check_interval_s)
            if done:
                return call.result()
            misses = 0 if await self._healthy() else misses + 1
            if misses >= 2:
                raise ServerUnavailableError(self.url, "stopped answering /health while a generation request "
                                             "was in flight; the request was abandoned")

    async def _healthy(self) -> bool:
        """Whether the server answers /health; one probe at a time, shared by every request waiting
        on it (and reused for half an interval), so N waiting requests do not mean N probes."""
        interval = self.http.health_check_interval_s or 5.0
        cached = self.http.health_cache.get(self.url)
        if cached is not None and time.monotonic() - cached[0] < interval / 2:
            return cached[1]
        probe = self.http.probes.get(self.url)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(min(5.0, interval)))
            self.http.probes[self.url] = probe
        return await asyncio.shield(probe)

    async def _probe(self, timeout: float) -> bool:
        healthy = await self._answers_health(timeout)
        self.http.health_cache[self.url] = (time.monotonic(), healthy)
        self.http.probes.pop(self.url, None)
        return healthy

    async def close(self) -> None:
        """The pools belong to the RemoteClient."""


class RemoteClient(FanOutClient):
    """InferenceClient over the HTTP API of `inflight.server` (one URL or several). `shm_chunks`:
    weight chunks go to the servers as chunk files in /dev/shm instead of request bodies (every
    server on this host; one copy instead of a socket transfer)."""

    def __init__(self, urls: str | Sequence[str], *, api_key: str | None = None,
                 control_token: str | None = None, request_timeout_s: float | None = None,
                 control_timeout_s: float | None = 600.0,
                 connect_timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.1,
                 health_check_interval_s: float | None = 5.0, chunk_bytes: int = 128 * 2**20,
                 shm_chunks: bool = False, max_connections: int = 1024, router: Router | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("RemoteClient needs at least one server URL")
        self.chunk_bytes, self.health_check_interval_s = chunk_bytes, health_check_interval_s
        self.shm_chunks = shm_chunks
        self.api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.control_headers = {"Authorization": f"Bearer {control_token}"} if control_token else {}
        self.generate_timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s, pool=None)
        self.control_timeout = httpx.Timeout(control_timeout_s, connect=connect_timeout_s, pool=None)
        self._limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        self._transport = transport
        # generation and control use separate connection pools, so that a pause or a health probe
        # never waits behind hundreds of generation connections; both are bound to one event loop
        self._pools: dict[str, httpx.AsyncClient] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.health_cache: dict[str, tuple[float, bool]] = {}  # url -> (when, healthy): one probe serves all
        self.probes: dict[str, asyncio.Future[bool]] = {}
        servers = [HttpClient(url, self) for url in self.urls]
        super().__init__(servers, self.urls, router or Router(self.urls), retries, backoff_s)

    def pool(self, name: str = "control") -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # an httpx client is bound to the loop it was first used on
            self._pools, self._loop = {}, loop
            self.health_cache, self.probes = {}, {}
        if name not in self._pools:
            self._pools[name] = httpx.AsyncClient(
                limits=self._limits, transport=self._transport, trust_env=False
            )
        return self._pools[name]

    async def __aenter__(self) -> RemoteClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def init_weight_transfer(self, master_address: str = "127.0.0.1", master_port: int = 0,
                                   **options: Any) -> dict[str, Any]:
        """Host a weight broadcast group (rank 0, rendezvous at master_address:master_port, 0 for a
        free port; an address the servers can reach) and have server i join it at rank i + 1.
        Returns once every rank has joined: master address and port, world size, backend and each
        server's rank. `override_existing`: a group a server is already in (e.g. one this client
        dropped after a failure, or a previous trainer's) is replaced; False makes that a conflict.
        `timeout_s` bounds the rendezvous and every broadcast. Chunks default to `chunk_bytes`."""
        group, self._weight_group = self._weight_group, None
        if group is not None and group.sender is not None:
            group.sender.close()  # the servers replace the group they are in (override_existing)
        options.setdefault("max_chunk_bytes", self.chunk_bytes)
        return await super().init_weight_transfer(master_address, master_port, **options)

    async def close_weight_transfer(self) -> None:
        """Have every server leave the broadcast group (also one this client no longer holds),
        then drop this side of it."""
        group, self._weight_group = self._weight_group, None
        try:
            await self._each("leave_weight_group")
        finally:
            if group is not None and group.sender is not None:
                group.sender.close()

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tensors (HF names) to every server in safetensors chunks of `chunk_bytes`, each
        chunk encoded once."""
        await self.send_chunks(named_tensors, lambda data: self._each("load_chunk", data))

    async def send_chunks(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                          send: Callable[[bytes | str], Awaitable[Any]]) -> None:
        """Encode the tensors in chunks of `chunk_bytes` and `send` each: its bytes, or with
        `shm_chunks` the name of a chunk file in /dev/shm (removed once sent)."""
        for chunk in wire.chunk_by_bytes(named_tensors, self.chunk_bytes):
            data = await asyncio.to_thread(wire.encode_tensors, chunk)
            if not self.shm_chunks:
                await send(data)
                continue
            name = await asyncio.to_thread(wire.write_chunk_file, data)
            del data
            try:
                await send(name)
            finally:
                wire.remove_chunk_file(name)

    async def health(self) -> dict[str, dict[str, Any]]:
        """Every server's /health answer (raises if any server does not answer)."""
        return await self._each("health")

    async def close(self) -> None:
        if self._weight_group is not None:
            with contextlib.suppress(Exception):  # best effort: a server that is gone has no group to leave
                await self.close_weight_transfer()
        if self._loop is asyncio.get_running_loop():
            for pool in self._pools.values():
                await pool.aclose()
        self._pools = {}
