"""Control routes: pause/resume, sleep/wake_up, reset_prefix_cache, weight updates (chunks over HTTP,
or over a broadcast group the server joins), and the read-only /weight_version, /status, /health,
/metrics. Every answer about the engine's state comes from one `AsyncEngine.status()` snapshot.

Parameters travel in the query string (`/pause?mode=keep`); a weight chunk is the request body, one
safetensors buffer of HF-named tensors; the broadcast-group routes take JSON bodies (see
`inflight.server.weight_transfer`). Mutating routes require the control token when one is set;
the read-only ones are open.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from inflight.client import wire
from inflight.engine.async_engine import AsyncEngine
from inflight.server.errors import APIError, error_response
from inflight.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from inflight.server.protocol import PauseMode
from inflight.server.weight_transfer import add_weight_transfer_routes
from inflight.weight_sync.receiver import engine_receiver


def build_control_router(engine: AsyncEngine, control_auth, metrics: ServerMetrics) -> APIRouter:
    """The control routes over `engine`; its receiver holds the server's broadcast-group membership."""
    router = APIRouter()
    guarded = [Depends(control_auth)]
    receiver = engine_receiver(engine)
    add_weight_transfer_routes(router, guarded, receiver)

    @router.post(wire.PAUSE, dependencies=guarded)
    async def pause(mode: PauseMode = "keep") -> dict[str, Any]:
        """abort: finish in-flight requests now; keep: freeze them; wait: let them finish first."""
        aborted = await engine.pause(mode)
        return {"success": True, "mode": mode, "paused": engine.status().paused, "num_aborted": len(aborted)}

    @router.post(wire.RESUME, dependencies=guarded)
    async def resume() -> dict[str, Any]:
        await engine.resume()
        return {"success": True, "paused": engine.status().paused}

    @router.post(wire.SLEEP, dependencies=guarded)
    async def sleep(offload_kv: bool = False) -> dict[str, Any]:
        await engine.sleep(offload_kv)
        return {"success": True, "offload_kv": offload_kv}

    @router.post(wire.WAKE_UP, dependencies=guarded)
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
        await engine.wake_up(tags)
        s = engine.status()
        return {"success": True, "weights_awake": s.weights_awake, "kv_cache_awake": s.kv_cache_awake}

    @router.post(wire.RESET_PREFIX_CACHE, dependencies=guarded)
    async def reset_prefix_cache(reset_running_requests: bool = False):
        """200 {"success": true} when the cache is now empty; 409 {"success": false, ...} when blocks
        held by running or frozen requests kept their hashes (never a silent 200)."""
        if await engine.reset_prefix_cache(reset_running_requests):
            return {"success": True}
        err = APIError(409, "the prefix cache is not empty: blocks held by running or frozen requests keep "
                       "their hashes; pass reset_running_requests=true or wait for them",
                       code="prefix_cache_not_reset")
        return error_response(err, extra={"success": False})

    @router.post(wire.WEIGHTS_BEGIN, dependencies=guarded)
    async def begin_weight_update() -> dict[str, Any]:
        await engine.begin_weight_update()
        receiver.clear_pieces()
        return {"success": True}

    @router.post(wire.WEIGHTS_CHUNK, dependencies=guarded)
    async def load_weights_chunk(request: Request, shm: str | None = None) -> dict[str, Any]:
        """The chunk's safetensors bytes: the body, or with `?shm=NAME` a chunk file in /dev/shm."""
        try:
            body = await request.body() if shm is None else await asyncio.to_thread(wire.read_chunk_file, shm)
            tensors = await asyncio.to_thread(wire.decode_tensors, body)
        except ValueError as err:
            raise APIError(400, str(err), code="invalid_weights") from err
        await engine.load_weights(tensors)
        return {"success": True, "num_tensors": len(tensors)}

    @router.post(wire.WEIGHTS_FINISH, dependencies=guarded)
    async def finish_weight_update(version: int | None = None) -> dict[str, Any]:
        new_version = await engine.finish_weight_update(version)
        return {"success": True, "weight_version": new_version}

    @router.post(wire.WEIGHTS_ABORT, dependencies=guarded)
    async def abort_weight_update() -> dict[str, Any]:
        restored = await engine.abort_weight_update()
        receiver.clear_pieces()
        return {"success": True, "restored": restored, "weight_version": engine.weight_version}

    @router.get(wire.WEIGHT_VERSION)
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @router.get(wire.STATUS)
    async def status() -> dict[str, Any]:
        """The engine's lifecycle state, queues and step loop (`AsyncEngine.status()`)."""
        return engine.status().to_dict()

    @router.get(wire.HEALTH)
    async def health() -> JSONResponse:
        """200 with the engine's state (status "updating" while a weight update is open or has left
        the weights incomplete); 503 with status "stalled" when work the engine could run has not
        been stepped for `AsyncEngine.stall_s` (a request that cannot make progress is never silent)."""
        s = engine.status()
        stalled = s.step_loop.stalled
        state = "stalled" if stalled else "updating" if s.update != "none" else "ok"
        return JSONResponse({
            "status": state, "update": s.update, "weight_version": s.weight_version, "paused": s.paused,
            "weights_awake": s.weights_awake, "kv_cache_awake": s.kv_cache_awake, "can_run": s.can_run,
            "weight_transfer": receiver.describe(), "step_loop": asdict(s.step_loop),
        }, status_code=503 if stalled else 200)

    @router.get(wire.METRICS)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
