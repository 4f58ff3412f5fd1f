"""Our routes over vLLM: the token route and the control routes, with the native server's answers
(`inflight/server/control.py`). Mutating control routes need the control token when one is set
(401 without, 403 when wrong); the token route needs the API key when one is set; `/weight_version`,
`/status`, `/health` and `/metrics` are open."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from .broadcast import BroadcastMember, add_broadcast_routes
from .errors import APIError, error_response, state_error, weight_error
from .generate import GenerateBody, restart_unstarted, run_request
from .logprob_modes import DEFAULT
from .metrics import render_metrics
from .state import INVALID, NONE, OPEN, PAUSED, RUNNING, Lifecycle
from .weights import WeightStage, reload

log = logging.getLogger("inflight.backends.vllm")
PAUSE_MODES = ("abort", "keep", "wait")


def bearer(token: str | None, what: str, wrong_status: int):
    """A dependency requiring `Authorization: Bearer <token>` (none when token is None)."""
    slug = what.lower().replace(" ", "_")

    async def check(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization")
        if not header:
            raise APIError(401, f"this route requires the {what}: send 'Authorization: Bearer <{what}>'",
                           code=f"missing_{slug}")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(value.strip().encode(), token.encode()):
            raise APIError(wrong_status, f"invalid {what}", code=f"invalid_{slug}")

    return check


def build_router(life: Lifecycle, stage: WeightStage, routes: Any, *, api_key: str | None,
                 control_token: str | None, max_model_len: int, member: BroadcastMember,
                 logprobs_mode: str = DEFAULT) -> APIRouter:
    """Every route of ours (paths from `routes`, i.e. inflight/client/routes.py); `member` is this
    server's place in a trainer's broadcast group (`broadcast.py`); `logprobs_mode` vLLM's."""
    router = APIRouter()
    guarded = [Depends(bearer(control_token, "control token", 403))]
    add_broadcast_routes(router, guarded, life, stage, member, routes)

    @router.post(routes.GENERATE, dependencies=[Depends(bearer(api_key, "API key", 401))])
    async def generate(body: GenerateBody, request: Request) -> Any:
        """Runs until done or until the client disconnects (then vLLM aborts the request)."""
        work = asyncio.create_task(run_request(life, body, max_model_len, logprobs_mode))
        watch = asyncio.create_task(_disconnect(request))
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            watch.cancel()
            return work.result()
        work.cancel()  # cancelling vLLM's generator aborts the request there
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=499)

    @router.post(routes.PAUSE, dependencies=guarded)
    async def pause(mode: str = "keep") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode={mode!r} must be one of {', '.join(PAUSE_MODES)}", param="mode")
        async with life.lock:
            aborted = await life.pause_engine(mode)
        await life.drained()  # mode=wait: until its requests finished or a resume ended the drain
        return {"success": True, "mode": mode, "paused": life.pause == PAUSED, "num_aborted": aborted}

    @router.post(routes.RESUME, dependencies=guarded)
    async def resume() -> dict[str, Any]:
        async with life.lock:
            if life.update != NONE or not (life.weights_awake and life.kv_cache_awake):
                raise state_error(f"cannot resume: the update state is {life.update!r}, weights awake: "
                                  f"{life.weights_awake}, KV cache awake: {life.kv_cache_awake}; finish a "
                                  "complete weight update (or abort it) and wake both pools first")
            await life.end_drain()
            life.pause, life.pause_mode = RUNNING, None
            await life.settle()
        return {"success": True, "paused": False}

    @router.post(routes.SLEEP, dependencies=guarded)
    async def sleep(offload_kv: bool = False) -> dict[str, Any]:
        """Our sleep: the weights count as dropped (a full update must land), the KV as offloaded
        (`offload_kv`: kept) or discarded; with vLLM's sleep mode (CUDA) memory is freed too."""
        async with life.lock:
            if offload_kv and life.frees_memory:
                raise APIError(
                    400,
                    "offload_kv=true cannot be kept here: vLLM's sleep (level 1) frees the KV "
                    "cache without a copy; sleep with offload_kv=false (the frozen requests are "
                    "reset and recomputed)",
                    param="offload_kv",
                )
            life.weights_awake = life.kv_cache_awake = False
            life.update, life.can_roll_back = INVALID, False  # our contract: sleep drops the weights
            stage.clear()
            if offload_kv:
                log.info("sleep(offload_kv=true): vLLM's KV cache stays in place, its memory not freed "
                         "(offload = keep)")
            else:
                life.kv_discarded = True
                log.info("sleep(offload_kv=false): the KV cache counts as discarded; every running or frozen "
                         "request is reset before it runs again")
            await life.settle()
            await life.sleep_engine()
        return {"success": True, "offload_kv": offload_kv}

    @router.post(routes.WAKE_UP, dependencies=guarded)
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
        wanted = set(tags or ("weights", "kv_cache"))
        if wanted - {"weights", "kv_cache"}:
            raise APIError(400, f"tags={sorted(wanted)}: known tags are weights and kv_cache", param="tags")
        async with life.lock:
            if "weights" in wanted:  # now: an update reloads into them (the KV pool wakes with the scheduler)
                await life.wake_engine(["weights"])
            life.weights_awake |= "weights" in wanted
            life.kv_cache_awake |= "kv_cache" in wanted
            await life.settle()
        return {"success": True, "weights_awake": life.weights_awake, "kv_cache_awake": life.kv_cache_awake}

    @router.post(routes.RESET_PREFIX_CACHE, dependencies=guarded)
    async def reset_prefix_cache(reset_running_requests: bool = False):
        async with life.lock:
            if reset_running_requests:
                ok = await life.reset_running("resets")
                life.kv_discarded = False  # nothing holds old KV any more
            else:
                ok = bool(await life.engine.reset_prefix_cache())
        if ok:
            return {"success": True}
        err = APIError(409, "the prefix cache is not empty: blocks held by running or frozen requests keep "
                       "their hashes; pass reset_running_requests=true or wait for them",
                       code="prefix_cache_not_reset")
        return error_response(err, extra={"success": False})

    @router.post(routes.WEIGHTS_BEGIN, dependencies=guarded)
    async def begin_weight_update() -> dict[str, Any]:
        async with life.lock:
            life.can_roll_back = life.update == NONE or life.can_roll_back
            life.update, life.update_touched = OPEN, time.monotonic()
            stage.clear()
            await life.settle()
        return {"success": True}

    @router.post(routes.WEIGHTS_CHUNK, dependencies=guarded)
    async def load_weights_chunk(request: Request, shm: str | None = None) -> dict[str, Any]:
        """The chunk's safetensors bytes: the body, or with `?shm=NAME` a chunk file in /dev/shm."""
        if life.update != OPEN:
            raise state_error(f"no weight update is open (state {life.update!r}): call begin first")
        life.update_touched = time.monotonic()  # the lease runs from the last chunk
        try:
            body = (
                await request.body() if shm is None else await asyncio.to_thread(routes.read_chunk_file, shm)
            )
        except ValueError as err:
            raise APIError(400, str(err), param="shm") from err
        tensors = await asyncio.to_thread(_decode, body)
        count = await asyncio.to_thread(stage.check_and_stage, tensors)
        return {"success": True, "num_tensors": count}

    @router.post(routes.WEIGHTS_FINISH, dependencies=guarded)
    async def finish_weight_update(version: int | None = None) -> dict[str, Any]:
        async with life.lock:
            return {"success": True, "weight_version": await _finish(life, stage, version)}

    @router.post(routes.WEIGHTS_ABORT, dependencies=guarded)
    async def abort_weight_update() -> dict[str, Any]:
        async with life.lock:
            stage.clear()
            restored = await life.abort_update()
        return {"success": True, "restored": restored, "weight_version": life.weight_version}

    @router.get(routes.WEIGHT_VERSION)
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": life.weight_version}

    @router.get(routes.STATUS)
    async def status() -> dict[str, Any]:
        return life.status()

    @router.get(routes.HEALTH)
    async def health() -> JSONResponse:
        try:
            await life.engine.check_health()
        except Exception as err:  # the engine is dead: say so
            return JSONResponse({"status": "dead", "error": f"{type(err).__name__}: {err}"}, status_code=503)
        s = life.status()
        return JSONResponse({"status": "updating" if s["update"] != NONE else "ok", "backend": "vllm",
                             **{k: s[k] for k in ("update", "weight_version", "paused", "weights_awake",
                                                  "kv_cache_awake", "can_run")},
                             "weight_transfer": member.describe()})

    @router.get(routes.METRICS)
    async def metrics() -> Response:
        return Response(render_metrics(life), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


async def expire_updates(life: Lifecycle, stage: WeightStage, every_s: float = 1.0) -> None:
    """Abandon an open update that received nothing for weight_update_timeout_s, as an abort would:
    a sender that died between begin and finish cannot keep vLLM paused (runs until cancelled)."""
    while True:
        await asyncio.sleep(every_s)
        if not life.update_expired(time.monotonic()):
            continue
        async with life.lock:
            if life.update_expired(time.monotonic()):
                stage.clear()
                restored = await life.abort_update()
                life.stats.expired_weight_updates += 1
                log.warning(
                    "abandoned a weight update that received nothing for %gs (weight_update_timeout_s); %s",
                    life.weight_update_timeout_s,
                    "the old weights serve"
                    if restored
                    else "the server stays unable to run until a complete update lands",
                )


async def _disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read: only the disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _decode(body: bytes) -> list[tuple[str, Any]]:
    from safetensors.torch import load

    if not body:
        raise APIError(400, "the body is empty; expected a safetensors buffer of HF-named tensors",
                       code="invalid_weights")
    try:
        return list(load(bytes(body)).items())
    except Exception as err:  # safetensors raises its own error types on bad bytes
        raise APIError(
            400, f"the body is not a valid safetensors buffer: {err}", code="invalid_weights"
        ) from err


async def _finish(life: Lifecycle, stage: WeightStage, version: int | None) -> int:
    """The staged update into vLLM in one reload, then the new version; our finish's rules."""
    if life.update != OPEN:
        raise state_error(f"no weight update is open (state {life.update!r}): call begin first")
    if "weights" in life.asleep:
        raise state_error(
            "the weights are asleep in vLLM: wake_up(tags=[weights]) before finishing an update"
        )
    new = life.weight_version + 1 if version is None else version
    missing, split = stage.missing(), stage.incomplete()
    problem = (
        f"split tensors never completed: {split}"
        if split
        else f"the update is incomplete: {len(missing)} parameters were not sent "
        f"(e.g. {', '.join(missing[:3])}); the vLLM backend takes full updates only"
        if missing
        else f"version={new} must be greater than the current weight version {life.weight_version}"
        if new <= life.weight_version
        else None
    )
    if problem:
        life.update = INVALID
        life.stats.failed_weight_updates += 1
        raise weight_error(problem + "; abort_weight_update() keeps the old weights")
    directory = await asyncio.to_thread(stage.write, new)
    try:
        await reload(life.engine, directory)
    except Exception as err:
        life.update, life.stats.failed_weight_updates = INVALID, life.stats.failed_weight_updates + 1
        stage.clear()
        try:
            await reload(life.engine, stage.complete_dir)
            life.stats.restored_weights += 1
            life.can_roll_back = True
            note = "the previous weights were reloaded; abort_weight_update() resumes on them"
        except Exception as again:
            life.can_roll_back = False
            note = (
                f"reloading the previous weights failed too ({again}); "
                "the weights are unknown: send a full update"
            )
        raise weight_error(f"vLLM failed to load the update: {type(err).__name__}: {err}; {note}") from err
    await life.engine.update_weight_version(str(new))  # labels every output token sampled from now on
    stage.landed(directory)
    life.weight_version, life.update, life.can_roll_back = new, NONE, True
    life.stats.weight_updates += 1
    await restart_unstarted(life, new)
    await life.settle()
    return new
