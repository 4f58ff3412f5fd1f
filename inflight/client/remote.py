"""RemoteClient: the InferenceClient protocol over HTTP, spanning one or more inference servers.

Generation goes to one server chosen by the Router (least outstanding requests, session affinity);
control calls (pause, weight updates, ...) fan out to every server concurrently and raise if any
server fails. Transport errors are retried with exponential backoff for idempotent calls; a
generation request is only re-sent when the server provably never got it (connection refused), and
then to another server. A server that dies mid-request closes the connection, which surfaces as
`ServerUnavailableError`; one that hangs without closing is caught by polling its /health while the
request waits. Weight updates can also carry their bytes over a broadcast group this client hosts
(`init_weight_transfer`, `update_weights_broadcast`; see `inflight.client.broadcast`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import torch

from inflight.client import wire
from inflight.client.base import update_all_or_nothing
from inflight.client.errors import (
    FanOutError,
    InconsistentServersError,
    RemoteError,
    ServerUnavailableError,
    error_from_response,
)
from inflight.client.router import Router
from inflight.engine.request import RequestOutput, SamplingParams

if TYPE_CHECKING:  # imported on use: torch.distributed and the weight-sync package
    from inflight.client.broadcast import WeightBroadcaster
    from inflight.weight_sync.chunking import WeightChunk

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_BROADCAST_GRACE_S = 10.0  # how long a chunk's broadcast may lag behind the servers' answers
# errors a server answers only after it has received the chunk's broadcast (the engine refused it)
_AFTER_BROADCAST_CODES = ("weight_update_error", "engine_state_error")


async def _group_in_step(err: BaseException, sent: asyncio.Future) -> bool:
    """After a broadcast chunk failed with `err`: whether every rank still took part in its
    broadcast (`sent`), i.e. the engines refused the tensors afterwards and the group is usable."""
    errors = err.errors.values() if isinstance(err, FanOutError) else [err]
    if not all(isinstance(e, RemoteError) and e.code in _AFTER_BROADCAST_CODES for e in errors):
        return False
    done, _ = await asyncio.wait({sent}, timeout=_BROADCAST_GRACE_S)
    return bool(done) and sent.exception() is None


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _top_logprobs(value: list[list[list[Any]]] | None) -> list[list[tuple[int, float]]] | None:
    """The token route's `top_logprobs` (JSON arrays) as RequestOutput holds them: (id, logprob) pairs."""
    if value is None:
        return None
    return [[(int(t), float(lp)) for t, lp in alternatives] for alternatives in value]


class RemoteClient:
    """InferenceClient over the HTTP API of `inflight.server` (one URL or several)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        control_token: str | None = None,
        request_timeout_s: float | None = None,
        control_timeout_s: float | None = 600.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        health_check_interval_s: float | None = 5.0,
        chunk_bytes: int = 128 * 2**20,
        max_connections: int = 1024,
        router: Router | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("RemoteClient needs at least one server URL")
        self.router = router or Router(self.urls)
        self.retries = retries
        self.backoff_s = backoff_s
        self.health_check_interval_s = health_check_interval_s
        self.chunk_bytes = chunk_bytes
        self._api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._control_headers = {"Authorization": f"Bearer {control_token}"} if control_token else {}
        self._generate_timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s, pool=None)
        self._control_timeout = httpx.Timeout(control_timeout_s, connect=connect_timeout_s, pool=None)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._transport = transport
        # generation and control use separate connection pools, so that a pause or a health probe
        # never waits behind hundreds of generation connections; both are bound to one event loop
        self._http: dict[str, httpx.AsyncClient] = {}
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._health: dict[str, tuple[float, bool]] = {}  # url -> (when, healthy): one probe serves all
        self._probes: dict[str, asyncio.Future[bool]] = {}
        self._broadcaster: WeightBroadcaster | None = None  # rank 0, once init_weight_transfer has run

    async def __aenter__(self) -> RemoteClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _client(self, pool: str = "control") -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http_loop is not loop:  # an httpx client is bound to the loop it was first used on
            self._http, self._http_loop = {}, loop
            self._health, self._probes = {}, {}
        if pool not in self._http:
            self._http[pool] = httpx.AsyncClient(limits=self._limits, transport=self._transport, trust_env=False)
        return self._http[pool]

    async def close(self) -> None:
        if self._broadcaster is not None:
            try:
                await self.close_weight_transfer(retries=0)
            except Exception:  # best effort: a server that is gone has no group to leave
                pass
        if self._http_loop is asyncio.get_running_loop():
            for client in self._http.values():
                await client.aclose()
        self._http = {}

    # ---- one HTTP call, with retries ----------------------------------------------------------
    async def _send(
        self,
        url: str,
        method: str,
        path: str,
        *,
        idempotent: bool,
        timeout: httpx.Timeout,
        headers: dict[str, str],
        allow: tuple[int, ...] = (),
        retries: int | None = None,
        pool: str = "control",
        **kwargs: Any,
    ) -> httpx.Response:
        retries = self.retries if retries is None else retries
        attempt = 0
        while True:
            try:
                response = await self._client(pool).request(
                    method, url + path, headers=headers, timeout=timeout, **kwargs
                )
            except httpx.TransportError as err:
                not_sent = isinstance(err, _NOT_SENT)
                if attempt >= retries or not (idempotent or not_sent):
                    what = "could not connect" if not_sent else "the connection failed mid-request"
                    raise ServerUnavailableError(
                        url, f"{method} {path}: {what} ({type(err).__name__}: {err or 'no detail'}) "
                        f"after {attempt + 1} attempt(s)", request_sent=not not_sent,
                    ) from err
                await asyncio.sleep(self.backoff_s * 2**attempt)
                attempt += 1
                continue
            if response.status_code >= 400 and response.status_code not in allow:
                raise error_from_response(url, response.status_code, _json(response))
            return response

    async def _fan_out(
        self, what: str, method: str, path: str, *, idempotent: bool = True, **kwargs: Any
    ) -> dict[str, httpx.Response]:
        """Send to every server at once; raise (naming each failing server) if any fails.
        `json_by_url` gives each server a JSON body of its own."""
        headers = {**self._control_headers, **kwargs.pop("headers", {})}
        json_by_url: dict[str, Any] | None = kwargs.pop("json_by_url", None)
        results = await asyncio.gather(
            *(
                self._send(url, method, path, idempotent=idempotent, timeout=self._control_timeout,
                           headers=headers, **({"json": json_by_url[url]} if json_by_url else {}), **kwargs)
                for url in self.urls
            ),
            return_exceptions=True,
        )
        errors = {url: r for url, r in zip(self.urls, results, strict=True) if isinstance(r, BaseException)}
        if errors:
            if len(self.urls) == 1:
                raise errors[self.urls[0]]
            raise FanOutError(what, errors, len(self.urls))
        return dict(zip(self.urls, results, strict=True))  # type: ignore[arg-type]

    # ---- generation ---------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> RequestOutput:
        """Generate on the server the router picks; fails over only when the request was not sent."""
        prompt = list(prompt_token_ids)
        body: dict[str, Any] = {
            "prompt_token_ids": prompt,
            "sampling_params": dataclasses.asdict(params or SamplingParams()),
        }
        if request_id is not None:
            body["request_id"] = request_id
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        failed: set[str] = set()
        last: ServerUnavailableError | None = None
        for attempt in range(self.retries + 1):
            url = self.router.pick(session_id, avoid=failed)
            self.router.acquire(url)
            try:
                data = await self._generate_on(url, body)
            except ServerUnavailableError as err:
                if err.request_sent:
                    raise
                last = err
                self.router.mark_down(url)
                failed.add(url)
                if len(failed) >= len(self.urls):  # every server refused: wait, then try them again
                    failed.clear()
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                continue
            finally:
                self.router.release(url)
            self.router.mark_up(url)
            return RequestOutput(
                request_id=data["request_id"],
                prompt_token_ids=prompt,
                output_token_ids=data["output_token_ids"],
                logprobs=data.get("logprobs"),
                token_weight_versions=data["token_weight_versions"],
                finish_reason=data["finish_reason"],
                num_recomputed_tokens=data.get("num_recomputed_tokens", 0),
                num_cached_tokens=data.get("num_cached_tokens", 0),
                top_logprobs=_top_logprobs(data.get("top_logprobs")),
            )
        assert last is not None
        raise last

    async def _generate_on(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        call = asyncio.ensure_future(
            self._send(url, "POST", wire.GENERATE, idempotent=False, retries=0, pool="generate",
                       timeout=self._generate_timeout, headers=self._api_headers, json=body)
        )
        call.add_done_callback(lambda t: t.cancelled() or t.exception())  # never "never retrieved"
        try:
            response = await self._watch(url, call)
        finally:
            if not call.done():
                call.cancel()  # closing the connection makes the server abort the request
        return response.json()

    async def _watch(self, url: str, call: asyncio.Future[httpx.Response]) -> httpx.Response:
        """Wait for `call`; give up if the server stops answering /health twice in a row."""
        if self.health_check_interval_s is None:
            return await call
        misses = 0
        while True:
            done, _ = await asyncio.wait({call}, timeout=self.health_check_interval_s)
            if done:
                return call.result()
            misses = 0 if await self._healthy(url) else misses + 1
            if misses >= 2:
                raise ServerUnavailableError(
                    url, "stopped answering /health while a generation request was in flight; "
                    "the request was abandoned"
                )

    async def _healthy(self, url: str) -> bool:
        """Whether `url` answers /health; one probe at a time per server, shared by every request
        waiting on it (and reused for half an interval), so N waiting requests do not mean N probes."""
        interval = self.health_check_interval_s or 5.0
        cached = self._health.get(url)
        if cached is not None and time.monotonic() - cached[0] < interval / 2:
            return cached[1]
        probe = self._probes.get(url)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(url, min(5.0, interval)))
            self._probes[url] = probe
        return await asyncio.shield(probe)

    async def _probe(self, url: str, timeout: float) -> bool:
        try:
            response = await self._client().get(url + wire.HEALTH, timeout=timeout)
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        self._health[url] = (time.monotonic(), healthy)
        self._probes.pop(url, None)
        return healthy

    # ---- control ------------------------------------------------------------------------------
    async def pause(self, mode: str = "keep") -> None:
        await self._fan_out(f"pause(mode={mode!r})", "POST", wire.PAUSE, params={"mode": mode})

    async def resume(self) -> None:
        await self._fan_out("resume()", "POST", wire.RESUME)

    async def sleep(self, offload_kv: bool = False) -> None:
        await self._fan_out(f"sleep(offload_kv={offload_kv})", "POST", wire.SLEEP,
                            params={"offload_kv": str(bool(offload_kv)).lower()})

    async def wake_up(self, tags: list[str] | None = None) -> None:
        params = {"tags": list(tags)} if tags is not None else None
        await self._fan_out(f"wake_up(tags={tags})", "POST", wire.WAKE_UP, params=params)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """True iff every server's prefix cache is now empty (a server answers 409 when not)."""
        responses = await self._fan_out(
            "reset_prefix_cache()", "POST", wire.RESET_PREFIX_CACHE, allow=(409,),
            params={"reset_running_requests": str(bool(reset_running_requests)).lower()},
        )
        results = {url: _json(r) for url, r in responses.items()}
        bad = {url: body for url, body in results.items() if not isinstance(body, dict) or "success" not in body}
        if bad:
            raise InconsistentServersError(f"reset_prefix_cache answers without 'success': {bad}")
        return all(bool(body["success"]) for body in results.values())

    async def begin_weight_update(self) -> None:
        await self._fan_out("begin_weight_update()", "POST", wire.WEIGHTS_BEGIN)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the tensors (HF names) to every server in safetensors chunks of `chunk_bytes`."""
        for chunk in wire.chunk_by_bytes(named_tensors, self.chunk_bytes):
            data = await asyncio.to_thread(wire.encode_tensors, chunk)
            await self._fan_out(
                f"load_weights({len(chunk)} tensors, {len(data)} bytes)", "POST", wire.WEIGHTS_CHUNK,
                content=data, headers={"Content-Type": wire.CONTENT_TYPE},
            )

    async def finish_weight_update(self, version: int | None = None) -> int:
        params = {"version": version} if version is not None else None
        responses = await self._fan_out(
            f"finish_weight_update({version})", "POST", wire.WEIGHTS_FINISH, idempotent=False, params=params
        )
        versions = {url: int(r.json()["weight_version"]) for url, r in responses.items()}
        if len(set(versions.values())) != 1:
            raise InconsistentServersError(f"servers finished the update at different versions: {versions}")
        return next(iter(versions.values()))

    async def abort_weight_update(self) -> bool:
        responses = await self._fan_out("abort_weight_update()", "POST", wire.WEIGHTS_ABORT, idempotent=False)
        return all(bool(r.json()["restored"]) for r in responses.values())

    # ---- weight updates over a broadcast group -----------------------------------------------------
    async def init_weight_transfer(
        self,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        *,
        backend: str | None = None,
        group_name: str = wire.DEFAULT_WEIGHT_GROUP,
        device: str | torch.device = "cpu",
        max_chunk_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float = 600.0,
        override_existing: bool = True,
    ) -> dict[str, Any]:
        """Host a weight broadcast group (rank 0, rendezvous at master_address:master_port, 0 for a
        free port; an address the servers can reach) and have server i join it at rank i + 1.
        Returns once every rank has joined: master address and port, world size, backend and each
        server's rank. `override_existing`: a group a server is already in (e.g. one this client
        dropped after a failure, or a previous trainer's) is replaced; False makes that a conflict.
        `timeout_s` bounds the rendezvous and every broadcast."""
        from inflight.client.broadcast import WeightBroadcaster, in_daemon_thread

        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None
        sender = WeightBroadcaster(
            len(self.urls) + 1, master_address, master_port, backend=backend, device=device,
            group_name=group_name, max_chunk_bytes=max_chunk_bytes or self.chunk_bytes, dtype=dtype,
            timeout_s=timeout_s,
        )
        ranks = {url: i + 1 for i, url in enumerate(self.urls)}
        bodies = {url: {**sender.init_request(r), "override_existing": override_existing} for url, r in ranks.items()}
        cancel = threading.Event()
        formed = in_daemon_thread(sender.connect, cancel)
        try:
            await self._fan_out("init_weight_transfer()", "POST", wire.INIT_WEIGHT_TRANSFER,
                                idempotent=False, json_by_url=bodies)
            await formed
        except BaseException:
            cancel.set()
            sender.close()
            raise
        self._broadcaster = sender
        return {"master_address": master_address, "master_port": sender.port, "world_size": sender.world_size,
                "backend": sender.backend, "group_name": group_name, "ranks": ranks}

    async def load_weights_broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send the tensors to every server over the broadcast group, one chunk at a time: each
        chunk's metadata over HTTP, its bytes in one broadcast (between begin and finish)."""
        sender = self._broadcaster
        if sender is None:
            raise RuntimeError("no weight broadcast group: call init_weight_transfer() first")
        for chunk in sender.chunks(named_tensors):
            await self._broadcast_chunk(sender, chunk)

    async def _broadcast_chunk(self, sender: WeightBroadcaster, chunk: WeightChunk) -> None:
        from inflight.client.broadcast import in_daemon_thread

        sent = in_daemon_thread(sender.send, chunk)
        try:
            await self._fan_out(f"load_weights_broadcast(chunk {chunk.index}, {chunk.nbytes} bytes)", "POST",
                                wire.WEIGHTS_BROADCAST, idempotent=False, json=chunk.metadata())
        except BaseException as err:
            if not await _group_in_step(err, sent):
                self._broadcaster = None
                sender.close()
                err.add_note("not every server took part in the chunk's broadcast; the weight group is "
                             "dropped: call init_weight_transfer() again")
            raise
        await sent

    async def update_weights_broadcast(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        """begin → load_weights_broadcast → finish on every server, all or nothing: on any failure
        the update is aborted (old weights back where the servers kept them) and the error re-raised."""
        if self._broadcaster is None:
            raise RuntimeError("no weight broadcast group: call init_weight_transfer() first")
        return await update_all_or_nothing(self, lambda: self.load_weights_broadcast(named_tensors), version)

    async def close_weight_transfer(self, retries: int | None = None) -> None:
        """Have every server leave the broadcast group, then drop this side of it."""
        sender, self._broadcaster = self._broadcaster, None
        try:
            await self._fan_out("close_weight_transfer()", "POST", wire.DESTROY_WEIGHT_TRANSFER, retries=retries)
        finally:
            if sender is not None:
                sender.close()

    async def weight_versions(self) -> dict[str, int]:
        responses = await self._fan_out("weight_version()", "GET", wire.WEIGHT_VERSION)
        return {url: int(r.json()["weight_version"]) for url, r in responses.items()}

    async def weight_version(self) -> int:
        """The servers' common weight version; raises InconsistentServersError if they differ."""
        versions = await self.weight_versions()
        if len(set(versions.values())) != 1:
            raise InconsistentServersError(f"servers are at different weight versions: {versions}")
        return next(iter(versions.values()))

    async def health(self) -> dict[str, dict[str, Any]]:
        """Every server's /health answer (raises if any server does not answer)."""
        responses = await self._fan_out("health()", "GET", wire.HEALTH)
        return {url: r.json() for url, r in responses.items()}
