"""The hf_generate server: our token route, the OpenAI completions route and the control routes over
one transformers model's `generate` (see the package docstring for what it cannot do).

Generation runs in a worker thread, one request at a time; `_Gate`, a stopping criterion called
after every token, records each token's weight version and is where a request freezes (pause keep,
sleep) or stops (pause abort). Weights change only while no request computes: a weight update must
begin paused, so every running request sits frozen in its gate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from inflight.client import wire

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Gate(StoppingCriteria):
    """Called after each generated token: records its weight version, waits while the server holds
    generation, and stops the request when it is aborted."""

    def __init__(self, state: State) -> None:
        self.state, self.versions, self.aborted, self.parked = state, [], False, False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.versions.append(self.state.version)
        self.parked = True  # frozen here while paused (keep) or asleep; an abort ends the wait
        while not self.state.running_free.wait(0.01) and not self.aborted:
            pass
        self.parked = False
        return torch.full((input_ids.shape[0],), self.aborted, dtype=torch.bool)


class State:
    """The model, its weight version, the pause state and the staged update."""

    def __init__(self, model: Any, version: int) -> None:
        self.model, self.version = model, version
        self.running_free = threading.Event()
        self.running_free.set()
        self.paused = self.asleep = False
        self.gates: set[_Gate] = set()
        self.lock = threading.Lock()  # one generation at a time
        self.staged: dict[str, torch.Tensor] | None = None

    def hold(self) -> None:
        self.running_free.clear()

    def release(self) -> None:
        if not (self.paused or self.asleep):
            self.running_free.set()


def _generate(state: State, prompt: list[int], sp: dict[str, Any]) -> dict[str, Any]:
    gate = _Gate(state)
    temperature = float(sp.get("temperature", 1.0))
    greedy = temperature == 0.0
    kwargs: dict[str, Any] = dict(max_new_tokens=int(sp.get("max_tokens", 16)), do_sample=not greedy,
                                  output_logits=True, return_dict_in_generate=True,
                                  stopping_criteria=StoppingCriteriaList([gate]), pad_token_id=0)
    if not greedy:
        kwargs.update(
            temperature=temperature, top_p=float(sp.get("top_p", 1.0)), top_k=int(sp.get("top_k", 0))
        )
    eos = list(sp.get("stop_token_ids") or [])
    if not sp.get("ignore_eos") and state.model.generation_config.eos_token_id is not None:
        ids = state.model.generation_config.eos_token_id
        eos += ids if isinstance(ids, list) else [ids]
    kwargs["eos_token_id"] = eos or None
    if not eos:
        kwargs["min_new_tokens"] = kwargs["max_new_tokens"]
    with state.lock:
        if sp.get("seed") is not None:
            torch.manual_seed(int(sp["seed"]))
        state.gates.add(gate)
        try:
            with torch.no_grad():
                out = state.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                           dtype=torch.long), **kwargs)
        finally:
            state.gates.discard(gate)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack(out.logits)[:len(tokens), 0].float()
    logprobs = torch.log_softmax(logits / (temperature if not greedy else 1.0), -1)
    chosen = logprobs.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()
    finish = "abort" if gate.aborted else "stop" if tokens and tokens[-1] in eos else "length"
    return {"output_token_ids": tokens, "logprobs": chosen if sp.get("logprobs", True) else None,
            "token_weight_versions": gate.versions[:len(tokens)], "finish_reason": finish}


def _stage(state: State, body: bytes) -> int:
    params = state.model.state_dict()
    tensors = wire.decode_tensors(body)
    for name, tensor in tensors:
        if name not in params or params[name].shape != tensor.shape:
            where = (
                "has no such parameter" if name not in params else f"has shape {tuple(params[name].shape)}"
            )
            raise HTTPException(400, f"weight {name!r} {tuple(tensor.shape)}: the model {where}")
    assert state.staged is not None
    state.staged.update(tensors)
    return len(tensors)


def build_app(state: State, tokenizer: Any, model_name: str, control_token: str | None = None) -> FastAPI:
    """The routes over `state` (control routes need `control_token` when one is given)."""
    app = FastAPI()

    def guard(authorization: str | None = Header(None)) -> None:
        if control_token and authorization != f"Bearer {control_token}":
            raise HTTPException(401, "this control route needs the server's control token")

    guarded = [Depends(guard)]

    async def run(prompt: list[int], sp: dict[str, Any]) -> dict[str, Any]:
        while state.paused or state.asleep:  # requests wait while generation is held
            await asyncio.sleep(0.01)
        return await asyncio.to_thread(_generate, state, prompt, sp)

    @app.post(wire.GENERATE)
    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        out = await run(list(body["prompt_token_ids"]), body.get("sampling_params") or {})
        return {"request_id": body.get("request_id") or uuid.uuid4().hex, **out}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
        sp = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed") if k in body}
        out = await run(ids, sp)
        text = tokenizer.decode(out["output_token_ids"], skip_special_tokens=True)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": out["finish_reason"]}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out["output_token_ids"])}}

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        tokens = tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return {"tokens": tokens, "count": len(tokens)}

    @app.post(wire.PAUSE, dependencies=guarded)
    async def pause(mode: str = "keep") -> dict[str, Any]:
        """keep: freeze the running request between two tokens; abort: stop it now; wait: let it finish."""
        if mode not in ("keep", "abort", "wait"):
            raise HTTPException(400, f"mode={mode!r}: use keep, abort or wait")
        state.paused = True
        aborted = 0
        if mode == "abort":
            for gate in list(state.gates):
                gate.aborted, aborted = True, aborted + 1
        elif mode == "keep":
            state.hold()
        # return once no request computes: finished (wait, abort) or frozen between two tokens (keep)
        while any(mode != "keep" or not gate.parked for gate in list(state.gates)):
            await asyncio.sleep(0.01)
        return {"success": True, "mode": mode, "paused": True, "num_aborted": aborted}

    @app.post(wire.RESUME, dependencies=guarded)
    async def resume() -> dict[str, Any]:
        state.paused = False
        state.release()
        return {"success": True, "paused": False}

    @app.post(wire.SLEEP, dependencies=guarded)
    async def sleep(offload_kv: bool = False) -> dict[str, Any]:
        state.asleep = True
        state.hold()
        while any(not gate.parked for gate in list(state.gates)):
            await asyncio.sleep(0.01)
        return {"success": True, "offload_kv": offload_kv, "memory_freed": False}

    @app.post(wire.WAKE_UP, dependencies=guarded)
    async def wake_up() -> dict[str, Any]:
        state.asleep = False
        state.release()
        return {"success": True, "weights_awake": True, "kv_cache_awake": True}

    @app.post(wire.RESET_PREFIX_CACHE, dependencies=guarded)
    async def reset_prefix_cache(reset_running_requests: bool = False):
        if reset_running_requests and state.gates:
            return JSONResponse(
                {
                    "success": False,
                    "error": "hf_generate cannot recompute a frozen request: its "
                    "KV lives inside transformers' generate loop",
                },
                status_code=409,
            )
        return {"success": True}  # no cache outlives a request

    @app.post(wire.WEIGHTS_BEGIN, dependencies=guarded)
    async def begin() -> dict[str, Any]:
        if state.gates and not state.paused:
            raise HTTPException(409, "pause the server before a weight update (a request is computing)")
        state.staged = {}
        return {"success": True}

    @app.post(wire.WEIGHTS_CHUNK, dependencies=guarded)
    async def chunk(request: Request, shm: str | None = None) -> dict[str, Any]:
        if state.staged is None:
            raise HTTPException(409, "no weight update is open: begin one first")
        try:
            body = await request.body() if shm is None else wire.read_chunk_file(shm)
            return {"success": True, "num_tensors": _stage(state, body)}
        except ValueError as err:
            raise HTTPException(400, str(err)) from err

    @app.post(wire.WEIGHTS_FINISH, dependencies=guarded)
    async def finish(version: int | None = None) -> dict[str, Any]:
        if state.staged is None:
            raise HTTPException(409, "no weight update is open: begin one first")
        params = state.model.state_dict()
        with torch.no_grad():
            for name, tensor in state.staged.items():
                params[name].copy_(tensor)
        state.staged, state.version = None, state.version + 1 if version is None else version
        return {"success": True, "weight_version": state.version}

    @app.post(wire.WEIGHTS_ABORT, dependencies=guarded)
    async def abort() -> dict[str, Any]:
        state.staged = None
        return {"success": True, "restored": True, "weight_version": state.version}

    @app.post(wire.INIT_WEIGHT_TRANSFER, dependencies=guarded)
    @app.post(wire.WEIGHTS_BROADCAST, dependencies=guarded)
    async def no_group() -> JSONResponse:
        return JSONResponse({"error": "hf_generate takes weights by the chunk route only: use "
                             "weight_sync_backend=inprocess or shm, not a broadcast group"}, status_code=501)

    @app.get(wire.WEIGHT_VERSION)
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": state.version}

    @app.get(wire.STATUS)
    async def status() -> dict[str, Any]:
        return {"paused": state.paused, "asleep": state.asleep, "num_running": len(state.gates),
                "weight_version": state.version, "kv_cache_usage": None}

    @app.get(wire.HEALTH)
    async def health() -> dict[str, Any]:
        update = "none" if state.staged is None else "open"
        return {"status": "ok" if update == "none" else "updating", "update": update,
                "weight_version": state.version, "paused": state.paused}

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight serve --backend hf_generate")
    p.add_argument("--backend", default="hf_generate")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--control-token", default=os.environ.get("INFLIGHT_CONTROL_TOKEN"))
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    return p


def main(argv: list[str]) -> int:
    """Load the model and serve until interrupted (the registry entry's `launch`)."""
    args = build_parser().parse_args(argv)  # a flag it cannot honour is an error, not ignored
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=DTYPES[args.dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    app = build_app(State(model, args.weight_version), tokenizer,
                    args.served_model_name or Path(args.model).resolve().name, args.control_token)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
