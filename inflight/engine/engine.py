"""LLMEngine: the synchronous step API and the weight-sync lifecycle (docs/design.md sections 3 and 5)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from functools import wraps
from pathlib import Path

import torch
from transformers import GenerationConfig

from inflight.engine.adapters import AdapterMerger, adapter_part
from inflight.engine.blocks import BlockPool
from inflight.engine.config import EngineConfig
from inflight.engine.errors import EngineStateError, InvalidRequestError, WeightUpdateError
from inflight.engine.kv_cache import KVCache, WeightsPool
from inflight.engine.lifecycle import (
    PAUSE_MODES,
    EngineStatus,
    PausePhase,
    PauseState,
    UpdatePhase,
    UpdateState,
)
from inflight.engine.models.linear import packed_compute_dtype, resolve_linear_backend
from inflight.engine.models.loader import load_model
from inflight.engine.multimodal import ImagePlan, MultimodalInput, VisionSpec, plan_images
from inflight.engine.request import Request, RequestOutput, SamplingParams
from inflight.engine.runner import ModelRunner, layer_ops
from inflight.engine.scheduler import Scheduler, SchedulerConfig
from inflight.engine.stats import EngineStats
from inflight.engine.weight_copy import WeightPiece, copy_weight

MEMORY_TAGS = ("weights", "kv_cache")

log = logging.getLogger(__name__)


def _locked(method):
    @wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _check_values(hf_name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse a tensor that is not floating point: an integer tensor would be cast into other
    numbers. NaN, inf and values beyond the engine dtype's range are refused by the copy itself
    (`engine/weight_copy.py`), where the check costs no pass of its own."""
    if not tensor.is_floating_point():
        raise WeightUpdateError(
            f"parameter {hf_name!r} is {str(tensor.dtype).removeprefix('torch.')}; weights must be floating "
            f"point (the engine holds {str(dtype).removeprefix('torch.')})"
        )


class LLMEngine:
    """A paged-KV inference engine that knows which weight version produced every block and token."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self._lock = threading.RLock()
        self.device = torch.device(config.device)
        self.model = load_model(config.model, config.torch_dtype, self.device)
        try:
            linear_backend = resolve_linear_backend(config.linear_backend, config.torch_dtype, self.device)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        self.model.use_packed_linears(packed_compute_dtype(linear_backend, config.torch_dtype))
        self.linear_backend = linear_backend
        self.model.use_ops(layer_ops(config.elementwise_backend, config.torch_dtype, self.device))
        hf = self.model.config
        self.max_model_len = min(
            config.max_model_len or hf.max_position_embeddings, hf.max_position_embeddings
        )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise InvalidRequestError(
                f"max_num_batched_tokens={config.max_num_batched_tokens} must be >= max_model_len="
                f"{self.max_model_len} when chunked prefill is off (or enable chunked prefill)"
            )
        self.vocab_size = hf.vocab_size
        self.eos_token_ids = self._eos_ids(config.model, hf)
        attn = self.model.model.layers[0].self_attn
        num_blocks = config.num_kv_blocks or self._blocks_for_budget(hf.num_hidden_layers, attn)
        self.kv_cache = KVCache(
            hf.num_hidden_layers, num_blocks, config.block_size, attn.num_kv_heads, attn.head_dim,
            config.torch_dtype, self.device,
        )
        self.weights = WeightsPool(self.model)
        self.stats = EngineStats()
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
            ),
            self.pool,
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, config.block_size, config.seed, config.attention_backend
        )
        self.weight_version = config.weight_version
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._pause = PauseState()
        self._update = UpdateState()
        self.adapters = AdapterMerger()  # base copies of the weights LoRA adapters were merged into
        # the storage the last update replaced (or an abort left unused): the next update writes into
        # it instead of allocating (double-buffered weights once rollback has kept a copy)
        self._spare_weights: dict[str, torch.Tensor] = {}

    # ---- set-up helpers -----------------------------------------------------------------------
    @staticmethod
    def _eos_ids(model_dir: str, hf_config) -> set[int]:
        ids: set[int] = set()
        candidates = [getattr(hf_config, "eos_token_id", None)]
        if (Path(model_dir) / "generation_config.json").is_file():
            candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
        for value in candidates:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def _blocks_for_budget(self, num_layers: int, attn) -> int:
        per_block = KVCache.bytes_per_block(
            num_layers, self.config.block_size, attn.num_kv_heads, attn.head_dim, self.config.torch_dtype
        )
        budget = int(self.config.kv_cache_memory_gib * 2**30) // per_block
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.config.block_size)
        return max(1, min(budget, useful))

    # ---- requests -----------------------------------------------------------------------------
    @_locked
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        multimodal: MultimodalInput | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError naming the bad value (nothing else changes).
        `multimodal`: the images of a vision-language prompt (its placeholders already in the ids)."""
        params, images = self._checked(prompt_token_ids, params, multimodal)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use by an unfinished request")
        request = Request(
            request_id, list(prompt_token_ids), params, next(self._arrivals), cache_salt, images
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

    @property
    def vision(self) -> VisionSpec | None:
        """What the model's images must be like; None for a text-only model (which refuses images)."""
        return self.model.vision

    def _plan_images(
        self, prompt_token_ids: list[int], multimodal: MultimodalInput | None
    ) -> ImagePlan | None:
        vision = self.model.vision
        if multimodal is not None:
            return plan_images(list(prompt_token_ids), multimodal, vision, type(self.model).__name__)
        if vision is not None and vision.image_token_id in prompt_token_ids:
            count = sum(t == vision.image_token_id for t in prompt_token_ids)
            raise InvalidRequestError(
                f"the prompt holds {count} image placeholder tokens ({vision.image_token_id}) but no images "
                "were given; pass the images (multimodal=MultimodalInput(...)) or drop the placeholders"
            )
        return None

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None,
        multimodal: MultimodalInput | None = None,
    ) -> SamplingParams:
        """Validate a request's input without queueing it; returns the params to use. Raises
        InvalidRequestError naming the bad value. Takes no lock (it reads only what never changes),
        so callers on an event loop can reject bad input while a step runs."""
        return self._checked(prompt_token_ids, params, multimodal)[0]

    def _checked(
        self, prompt_token_ids: list[int], params: SamplingParams | None, multimodal: MultimodalInput | None,
    ) -> tuple[SamplingParams, ImagePlan | None]:
        params = params or SamplingParams()
        params.validate()
        if params.top_logprobs > self.vocab_size:
            raise InvalidRequestError(
                f"top_logprobs={params.top_logprobs} exceeds the vocabulary size {self.vocab_size}"
            )
        if params.return_routed_experts and self.model.routing_shape is None:
            raise InvalidRequestError(
                f"return_routed_experts=True: {type(self.model).__name__} has no mixture-of-experts layers, "
                "so there is no routing to return; leave it false for this model"
            )
        if not prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}, "
                f"so prompts must be at most {self.max_model_len - 1} tokens"
            )
        longest = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        needed = -(-longest // self.config.block_size)
        if needed > self.pool.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {needed} KV blocks ({longest} tokens) but the cache has "
                f"{self.pool.num_blocks}; lower max_tokens or raise num_kv_blocks/kv_cache_memory_gib"
            )
        return params, self._plan_images(prompt_token_ids, multimodal)

    @_locked
    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish the given requests now with finish_reason 'abort'; unknown ids are ignored."""
        outputs = []
        for request_id in list(request_ids):
            request = self.requests.get(request_id)
            if request is not None:
                outputs.append(self._finish(request, "abort"))
                self.stats.aborted_requests += 1
        self._pending_outputs.extend(outputs)
        self._check_drained()  # aborting the last in-flight request completes a wait pause
        return outputs

    @_locked
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or frozen."""
        return self.scheduler.has_unfinished()

    @_locked
    def has_work(self) -> bool:
        """Whether step() would return outputs or run the model now."""
        return bool(self._pending_outputs) or (self.can_run and self.scheduler.has_unfinished())

    @_locked
    def get_request_output(self, request_id: str) -> RequestOutput | None:
        """A snapshot of an unfinished request's progress (None when unknown or finished)."""
        request = self.requests.get(request_id)
        return request.to_output() if request is not None else None

    # ---- stepping -----------------------------------------------------------------------------
    @property
    def can_run(self) -> bool:
        """Whether step() would run the model (not paused, awake, weights complete)."""
        return not self.is_paused and self._update.phase is UpdatePhase.NONE and self._awake

    @property
    def _awake(self) -> bool:
        return self.weights.awake and self.kv_cache.awake

    @property
    def is_paused(self) -> bool:
        """Whether a pause is in force (a `wait` pause once its drain has ended)."""
        return self._pause.phase is PausePhase.PAUSED

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every public method holds: hold it to make several calls one step."""
        return self._lock

    @property
    def is_draining(self) -> bool:
        """Whether a pause(mode='wait') is letting its in-flight requests finish."""
        return self._pause.phase is PausePhase.DRAINING

    def status(self) -> EngineStatus:
        """A snapshot of the lifecycle state and the queues. Takes no lock (every state it reads is
        replaced whole), so it answers while a step runs; hold `lock` for one between two steps."""
        pause, update, can_run = self._pause, self._update, self.can_run
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        return EngineStatus(
            weight_version=self.weight_version, pause=pause.phase, pause_mode=pause.mode,
            update=update.phase, can_roll_back=update.rollback is not None,
            weights_awake=self.weights.awake, kv_cache_awake=self.kv_cache.awake, can_run=can_run,
            num_running=running, num_waiting=waiting, num_frozen=0 if can_run else running,
            kv_cache_usage=self.pool.usage(),
        )

    @_locked
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step; returns the requests that finished (or were aborted)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self.can_run or not self.scheduler.has_unfinished():
            return outputs
        out = self.scheduler.schedule(self.weight_version)
        self.stats.book(out)
        scheduled = out.scheduled
        if not scheduled:
            return outputs
        sampled = self.runner.execute(scheduled)
        self.scheduler.after_step(scheduled)
        self.stats.steps += 1
        for request, n in scheduled:
            if request.num_output_tokens == 0:
                self.stats.prompt_tokens_computed += n
        for request, token, logprob, top in sampled:
            request.append_token(token, logprob, self.weight_version, top)
            self.stats.generated_tokens += 1
            reason = self._stop_reason(request, token)
            if reason is not None:
                outputs.append(self._finish(request, reason))
        self._check_drained()
        return outputs

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> RequestOutput:
        routed = self.runner.routed_experts(request)  # read through the blocks that finish() frees
        self.scheduler.finish(request, reason)
        del self.requests[request.request_id]
        self.stats.finished_requests += 1
        output = request.to_output()
        if routed is not None:
            output.routed_experts, output.routed_experts_start = routed
        return output

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
        multimodal: list[MultimodalInput | None] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion and return their outputs in order (`multimodal`: each
        prompt's images, or None)."""
        if not self.can_run:
            raise EngineStateError("engine is paused, asleep or mid-update; resume() it before generate()")
        param_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        images = multimodal if multimodal is not None else [None] * len(prompts)
        for request_id, prompt, p, mm in zip(ids, prompts, param_list, images, strict=True):
            self.add_request(request_id, prompt, p, multimodal=mm)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for output in self.step():
                results[output.request_id] = output
            if not self.can_run and len(results) < len(ids):
                raise EngineStateError("engine was paused during generate()")
        return [results[i] for i in ids]

    # ---- pause / resume -----------------------------------------------------------------------
    @_locked
    def pause(self, mode: str = "keep") -> list[RequestOutput]:
        """Pause generation: 'abort' finishes in-flight requests now, 'keep' freezes them in place,
        'wait' lets requests already added run to completion first. Returns aborted outputs."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        if self.is_paused or (self.is_draining and mode == "wait"):
            return []  # a second wait must not move the admission cutoff past later arrivals
        self.stats.pauses += 1
        if mode == "wait":
            self._set_pause(PauseState(PausePhase.DRAINING, mode, cutoff=next(self._arrivals)))
            self._check_drained()
            return []
        self._set_pause(PauseState(PausePhase.PAUSED, mode))
        if mode == "abort":
            return self.abort([r.request_id for r in self.scheduler.unfinished()])
        return []

    def _set_pause(self, state: PauseState) -> None:
        """Every pause transition: while draining, the scheduler admits arrivals up to the cutoff only."""
        self._pause = state
        self.scheduler.admission_cutoff = state.cutoff

    def _check_drained(self) -> None:
        """A drain ends (paused) once every unfinished request arrived after its cutoff."""
        cutoff = self._pause.cutoff
        if self.is_draining and all(r.arrival > cutoff for r in self.scheduler.unfinished()):
            self._set_pause(PauseState(PausePhase.PAUSED, "wait"))

    @_locked
    def resume(self) -> None:
        """Undo any pause. Refuses while a pool sleeps or the weights are incomplete."""
        if not self._awake:
            raise EngineStateError("cannot resume while asleep; wake_up(['weights', 'kv_cache']) first")
        if self._update.phase is not UpdatePhase.NONE:
            raise EngineStateError(
                "cannot resume on incomplete weights; finish a complete weight update first"
            )
        self._set_pause(PauseState())
        self.stats.kv_invalidated_resets += self.scheduler.invalidate_stale_kv()

    # ---- memory pools -------------------------------------------------------------------------
    @_locked
    def sleep(self, offload_kv: bool = False) -> None:
        """Free both pools. Weights are dropped (a full update must follow); the KV pool is moved
        to host memory when `offload_kv`, else discarded (a new KV epoch)."""
        self.kv_cache.sleep(offload=offload_kv)
        if not offload_kv:
            self.pool.invalidate_all()
        self.weights.sleep()
        self._spare_weights = {}
        # gone with the weights: the rollback copy and what an update in progress had loaded
        still_open = self._update.phase is UpdatePhase.OPEN
        self._update = UpdateState(UpdatePhase.OPEN, intact=False) if still_open else UpdateState.invalid()

    @_locked
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate the named pools ('weights', 'kv_cache'; default both) at the same block ids."""
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise InvalidRequestError(f"unknown memory tags {unknown}; use {list(MEMORY_TAGS)}")
        if "weights" in tags:
            self.weights.wake_up()
        if "kv_cache" in tags:
            self.kv_cache.wake_up()

    @_locked
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached, unreferenced block hash; with `reset_running_requests`, first reset
        every running and frozen request (re-prefilled on resume). True iff the cache is empty."""
        if reset_running_requests:
            self.stats.resets += self.scheduler.reset_all()
        return self.pool.reset_prefix_cache()

    # ---- weight updates -----------------------------------------------------------------------
    @_locked
    def begin_weight_update(self) -> None:
        """Start an update; generation does not run until it finishes with every parameter or is
        aborted. With `weight_update_rollback` and complete weights now, abort_weight_update()
        can bring the current weights back."""
        if not self.weights.awake:
            raise EngineStateError("weights are asleep; wake_up(['weights']) before a weight update")
        update = self._update
        now = time.monotonic()
        if update.phase is UpdatePhase.NONE:
            rollback = {} if self.config.weight_update_rollback else None
            self._update = UpdateState(UpdatePhase.OPEN, rollback=rollback, touched=now)
        else:  # restarting an open or failed update keeps what it can roll back to
            self._drop_pieces(update)
            self._update = UpdateState(UpdatePhase.OPEN, rollback=update.rollback, intact=update.intact,
                                       touched=now)

    @_locked
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor | WeightPiece]]) -> None:
        """Copy a chunk of HF-named tensors (cast to the engine dtype). A bad chunk raises
        WeightUpdateError and leaves the engine blocked until a complete update lands.

        A weight may come as `WeightPiece`s over several chunks (a transport's buffer smaller than
        it), in order: each is copied straight into place, and the weight is set with its last."""
        update = self._update
        if update.phase is not UpdatePhase.OPEN:
            raise EngineStateError("call begin_weight_update() before load_weights()")
        if not self.weights.awake:
            raise EngineStateError("weights are asleep; wake_up(['weights']) before load_weights()")
        chunk = list(named_tensors)
        self._update = update = replace(update, touched=time.monotonic())  # the lease runs from here
        try:
            chunk = list(self.model.split_fused(chunk))  # MoE: fused expert tensors to per-expert weights
            adapter = [(n, t) for n, t in chunk if adapter_part(n) is not None]
            chunk = [(n, t) for n, t in chunk if adapter_part(n) is None]
            self._check_chunk(chunk)
            pieces = self._check_adapter(adapter)
            if (pieces or update.adapter) and (chunk or update.loaded):
                raise WeightUpdateError("an update carries full weights or a LoRA adapter, not both")
            loaded = self.model.copy_weights(chunk, keep_old=update.rollback, spares=self._spare_weights,
                                             partial=update.pieces)
            for name, part, tensor in pieces:
                update.adapter.setdefault(name, {})[part] = tensor
        except WeightUpdateError:
            self._update = replace(update, intact=False)
            self.stats.failed_weight_updates += 1
            raise
        update.loaded.update(loaded)
        # overwritten in place: no abort brings them back
        if (loaded or update.pieces) and update.rollback is None:
            self._update = replace(update, intact=False)

    def _check_chunk(self, chunk: list[tuple[str, torch.Tensor | WeightPiece]]) -> None:
        params = self.model.parameters_by_name()
        for hf_name, tensor in chunk:
            name = self.model.resolve(hf_name)
            if name is None:
                continue
            if name not in params:
                raise WeightUpdateError(f"unknown parameter {hf_name!r}; the model has no such weight")
            known = isinstance(tensor, torch.Tensor) or (
                isinstance(tensor, WeightPiece)
                and isinstance(tensor.data, torch.Tensor)
                and tensor.data.dim() == 1
            )
            if not known or tuple(tensor.shape) != tuple(params[name].shape):
                shape = tuple(tensor.shape) if known else type(tensor).__name__
                raise WeightUpdateError(
                    f"parameter {hf_name!r} has shape {shape}, expected {tuple(params[name].shape)}"
                )
            _check_values(
                hf_name, tensor.data if isinstance(tensor, WeightPiece) else tensor, params[name].dtype
            )

    def _drop_pieces(self, update: UpdateState) -> None:
        """Forget split weights still missing pieces; their spare buffers serve the next update."""
        for entry in update.pieces.values():
            if entry.spare:
                self._spare_weights.setdefault(entry.name, entry.dest)
        update.pieces.clear()

    def _check_adapter(self, adapter: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, torch.Tensor]]:
        """(weight, part, float32 copy) of each adapter tensor, checked against the weight it adapts
        (the copy: a chunk's tensors may be views of a buffer the sender reuses)."""
        if not adapter:
            return []
        params = self.model.parameters_by_name()
        out = []
        for hf_name, tensor in adapter:
            if not isinstance(tensor, torch.Tensor):  # a WeightPiece too: adapters are small, sent whole
                raise WeightUpdateError(
                    f"adapter tensor {hf_name!r} is a {type(tensor).__name__}, not a tensor"
                )
            target, _ = adapter_part(hf_name)
            name, part = self.adapters.check(hf_name, tensor, params.get(self.model.resolve(target) or ""))
            _check_values(hf_name, tensor, torch.float32)
            copy = torch.empty(tensor.shape, dtype=torch.float32)
            copy_weight(copy, tensor.detach(), hf_name)  # NaN or inf refused here, as in any weight
            out.append((name, part, copy))
        return out

    def _merge_adapter(self, update: UpdateState) -> None:
        """Write `W0 + B @ A` into every weight the adapter (or an earlier one) touched."""
        params = self.model.parameters_by_name()
        # the adapter names its weights as the trainer does (a VL model's `model.language_model.`):
        # the parameter each one adapts is found through the model's resolve, as a full update's are
        targets = {name: params[self.model.resolve(name)] for name in update.adapter}
        merged = self.adapters.merged(targets, update.adapter)
        update.loaded.update(self.model.copy_weights(merged.items(), keep_old=update.rollback,
                                                     spares=self._spare_weights))

    @_locked
    def finish_weight_update(self, version: int | None = None) -> int:
        """Complete the update: every parameter must have been loaded since begin_weight_update().
        Sets weight_version to `version` (must increase; default: +1) and returns it."""
        update = self._update
        if update.phase is not UpdatePhase.OPEN:
            raise EngineStateError("no weight update in progress; call begin_weight_update() first")
        new_version = self.weight_version + 1 if version is None else version
        is_adapter = bool(update.adapter)
        if is_adapter and new_version > self.weight_version:
            try:
                if not update.intact:
                    raise WeightUpdateError(
                        "a LoRA adapter is merged onto the weights the engine holds, and this engine's "
                        "weights are incomplete (dropped by sleep, or a failed update): send the full weights"
                    )
                self._merge_adapter(update)
            except WeightUpdateError:
                self._drop_pieces(update)
                self._update = UpdateState.invalid(update.rollback)
                self.stats.failed_weight_updates += 1
                raise
        missing = [] if is_adapter else sorted(self.model.hf_parameter_names() - update.loaded)
        split = sorted(update.pieces)
        if split or missing or new_version <= self.weight_version:
            self._drop_pieces(update)
            self._update = UpdateState.invalid(update.rollback)  # abort_weight_update() may still restore
            self.stats.failed_weight_updates += 1
            if split:
                raise WeightUpdateError(
                    f"split tensors never completed: {split[:3]}; the engine stays paused until a complete "
                    "update lands"
                )
            if missing:
                raise WeightUpdateError(
                    f"incomplete weight update: {len(missing)} parameters missing, e.g. {missing[:3]}; "
                    "the engine stays paused until a complete update lands"
                )
            raise WeightUpdateError(
                f"weight version {new_version} must be greater than the current {self.weight_version}"
            )
        if not is_adapter:
            self.adapters.forget()  # the base weights are the ones just loaded
        self._spare_weights.update(update.rollback or {})  # the replaced weights: the next one's target
        self._update = UpdateState()
        self.weight_version = new_version
        self.stats.weight_updates += 1
        return new_version

    @_locked
    def expire_weight_update(self, now: float | None = None) -> bool:
        """Abandon an open update that has received nothing for `weight_update_timeout_s` (its
        sender died or hung), as `abort_weight_update()` would; returns True when it did. Called
        by the AsyncEngine's step loop, which looks at least every IDLE_RECHECK_S."""
        update, timeout = self._update, self.config.weight_update_timeout_s
        if update.phase is not UpdatePhase.OPEN or timeout is None:
            return False
        idle = (time.monotonic() if now is None else now) - update.touched
        if idle < timeout:
            return False
        restored = self.abort_weight_update()
        self.stats.expired_weight_updates += 1
        log.warning(
            "abandoned a weight update that received nothing for %.0f s (weight_update_timeout_s=%g); %s",
            idle,
            timeout,
            "the old weights are back"
            if restored
            else "the engine stays unable to run until a complete update lands",
        )
        return True

    @_locked
    def abort_weight_update(self) -> bool:
        """Abandon the update in progress (or the one that just failed). Returns True when the
        weights from before begin_weight_update() are back (version unchanged, generation may
        resume); False when there was nothing to roll back to (after sleep, or rollback disabled):
        the engine then stays unable to run until a complete update lands, unless the abandoned
        update had not overwritten any parameter of complete weights yet."""
        update = self._update
        self._drop_pieces(update)
        if update.rollback is None:
            if update.phase is UpdatePhase.OPEN:
                self._update = UpdateState() if update.intact else UpdateState.invalid()
            return False
        params = self.model.parameters_by_name()
        for name, old in update.rollback.items():
            self._spare_weights[name] = params[name].data  # what the abandoned update wrote: reused
            params[name].data = old
        self.model.weights_changed()
        self._update = UpdateState()
        return True
