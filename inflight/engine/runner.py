"""Packs the scheduled requests into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import numpy as np
import torch

from inflight.engine import kernels
from inflight.engine.attention import PrefillChunk, Workspace, build_metadata, native_supports
from inflight.engine.kv_cache import KVCache
from inflight.engine.models.common import DecoderForCausalLM
from inflight.engine.models.layer_ops import NativeOps, TorchOps
from inflight.engine.multimodal import MultimodalStep
from inflight.engine.request import Request
from inflight.engine.routing import RoutingCache
from inflight.engine.sampler import TopLogprobs, sample, score_tokens

PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per LM-head pass: [rows, vocab] floats at a time


def native_library(key: str, backend: str, dtype: torch.dtype, device: torch.device, holds: str):
    """The native kernel library for the setting `key` (auto | native | torch), or None to use
    PyTorch: always for `torch`, and for `auto` where the kernels do not apply or build. `native`
    raises NativeKernelError naming `key` when it cannot run."""
    if backend == "torch":
        return None
    if not native_supports(dtype, device):
        if backend == "native":
            raise kernels.NativeKernelError(
                f"{key}='native' supports CPU float32/bfloat16 {holds}, not {dtype} on {device}; "
                f"use {key}='torch' or 'auto'"
            )
        return None
    return kernels.load(required=backend == "native")


def layer_ops(backend: str, dtype: torch.dtype, device: torch.device) -> TorchOps:
    """The elementwise implementation for `EngineConfig.elementwise_backend`."""
    lib = native_library("elementwise_backend", backend, dtype, device, "models")
    return TorchOps() if lib is None else NativeOps(lib)


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        block_size: int,
        seed: int,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self.workspace = Workspace()
        self.native_lib = native_library(
            "attention_backend", attention_backend, kv_cache.dtype, kv_cache.device, "KV caches"
        )
        # MoE models: the experts that computed each KV slot (None for a dense model)
        self.routing = RoutingCache.for_model(model, kv_cache.shape[2] * block_size, block_size, self.device)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]]
    ) -> list[tuple[Request, int, float | None, TopLogprobs | None]]:
        """Run one step; returns (request, token, logprob, top logprobs) for each request that reached
        its end (None where the request did not ask)."""
        # decodes longest context first: attention groups them by similar length
        decodes = sorted(((r, n) for r, n in scheduled if n == 1), key=lambda rn: -rn[0].num_computed_tokens)
        prefills = [(r, n) for r, n in scheduled if n > 1]
        ordered = decodes + prefills
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for request, n in ordered:
            start = request.num_computed_tokens
            input_ids.extend(request.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(request.block_ids[p // size] * size + p % size for p in range(start, start + n))
        chunks, offset = [], len(decodes)
        for request, n in prefills:
            chunks.append(PrefillChunk(offset, n, request.num_computed_tokens + n))
            offset += n
        meta = build_metadata(
            slots,
            [r.block_ids for r, _ in decodes],
            [r.num_computed_tokens + 1 for r, _ in decodes],
            chunks,
            [r.block_ids for r, _ in prefills],
            size,
            self.device,
            self.workspace,
            self.native_lib,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        routing = None if self.routing is None else self.routing.buffer(len(input_ids))
        if any(r.images is not None for r, _ in ordered):
            hidden = self.model(ids, pos, meta, self.kv_cache, routing, self._multimodal(ordered))
        else:
            hidden = self.model(ids, pos, meta, self.kv_cache, routing)
        if routing is not None:
            self.routing.store(meta.slot_mapping, routing)
        if any(r.needs_prompt_logprobs for r, _ in ordered):
            self._score_prompts(hidden, ordered)
        rows, samplers, offset = [], [], 0
        for request, n in ordered:
            offset += n
            if request.num_computed_tokens + n == request.num_tokens:
                rows.append(offset - 1)
                samplers.append(request)
        if not rows:
            return []
        if len(rows) < hidden.shape[0]:  # a decode step samples every row: no gather then
            hidden = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(hidden)
        tokens, logprobs, tops = sample(
            logits, [r.params for r in samplers], [r.generator for r in samplers], self.generator
        )
        return list(zip(samplers, tokens, logprobs, tops, strict=True))

    def _multimodal(self, ordered: list[tuple[Request, int]]) -> MultimodalStep:
        """The M-RoPE positions of the step's tokens and the image embeddings of its placeholder
        rows (a text request's positions are its token indices on all three axes)."""
        positions, rows, embeds, offset = [], [], [], 0
        for request, n in ordered:
            start, plan = request.num_computed_tokens, request.images
            if plan is None:
                positions.append(torch.arange(start, start + n).expand(3, -1))
            else:
                positions.append(plan.positions_of(start, n))
                for row, emb in plan.embeddings(
                    start, n, self.model.encode_images, self.model.weight_generation
                ):
                    rows.append(torch.arange(offset + row, offset + row + emb.shape[0]))
                    embeds.append(emb)
            offset += n
        hidden = self.model.config.hidden_size
        return MultimodalStep(
            torch.cat(positions, dim=1).to(self.device),
            torch.cat(rows).to(self.device) if rows else torch.empty(0, dtype=torch.long, device=self.device),
            torch.cat(embeds) if embeds else torch.empty(0, hidden, device=self.device),
        )

    def _score_prompts(self, hidden: torch.Tensor, ordered: list[tuple[Request, int]]) -> None:
        """Prompt logprobs of the requests that ask: the hidden row of position p scores prompt
        token p + 1. Each prompt position is scored once, in order, whichever chunk computes it
        (a position computed again after a reset or preemption keeps its first score)."""
        offset = 0
        for request, n in ordered:
            start = request.num_computed_tokens
            if request.needs_prompt_logprobs:
                first = max(start, len(request.prompt_logprobs) - 1)  # the next unscored token's position
                end = min(start + n, request.num_prompt_tokens - 1)
                for lo in range(first, end, PROMPT_LOGPROB_ROWS):
                    hi = min(lo + PROMPT_LOGPROB_ROWS, end)
                    rows = torch.arange(offset + lo - start, offset + hi - start, device=self.device)
                    logits = self.model.compute_logits(hidden[rows])
                    values, ranks, tops = score_tokens(logits, request.token_ids[lo + 1 : hi + 1],
                                                       request.params.prompt_logprobs)
                    request.add_prompt_logprobs(values, ranks, tops)
            offset += n

    def routed_experts(self, request: Request) -> tuple[np.ndarray, int] | None:
        """(routing record, first position) of a request, read from its block table (so call it
        before its blocks are freed); None for a dense model. See `RequestOutput.routed_experts`."""
        if self.routing is None:
            return None
        start = 0 if request.params.return_routed_experts else request.num_prompt_tokens - 1
        return self.routing.read(request.block_ids, start, request.num_computed_tokens), start
