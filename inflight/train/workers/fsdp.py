"""FSDPPolicyWorker: a transformers causal LM sharded with FSDP2 (`fully_shard`).

Each decoder layer is its own FSDP unit and the root holds the rest (embeddings, final norm, LM
head). Training is the base class's micro-batched step (FSDP2 all-gathers parameters for the
forward and reduce-scatters averaged gradients); AdamW steps on the local shards. For a weight
sync every parameter is gathered to a full tensor (`DTensor.full_tensor()`, one all-gather per
parameter, in `named_parameters()` order on every rank, so memory never holds more than one full
parameter beyond the shards); the names are the Hugging Face ones, which FSDP2 keeps unchanged.

With `bf16`, FSDP2's `MixedPrecisionPolicy` does what autocast does for the local worker: the
shards (the master weights) and AdamW stay float32, each unit's parameters are all-gathered in
bfloat16 for the compute, and gradients are reduced in float32.

torch.distributed must be initialised by the caller (gloo on CPU, nccl on CUDA) with this worker's
rank and world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from inflight.config import ConfigError, Violation
from inflight.train.lora import lora_enabled
from inflight.train.workers.local import LocalPolicyWorker


class FSDPPolicyWorker(LocalPolicyWorker):
    """One FSDP2 rank. Same constructor as `LocalPolicyWorker`; `rank`/`world_size` default to
    torch.distributed's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if lora_enabled(self.cfg):
            raise ConfigError([Violation("trainer.policy.model.lora.rank", self.cfg.trainer.policy.model.lora.rank,
                                         "LoRA on FSDP ranks is not implemented yet",
                                         "run one policy rank (the local worker), or set lora.rank=0")])
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def build_model(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FSDPPolicyWorker needs torch.distributed initialised (init_process_group)")
        model = self.load_hf_model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
        options = {"mp_policy": policy} if policy is not None else {}
        for layer in model.model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        self.model = model

    def logprobs_chunk_size(self) -> int | None:
        """None: the chunks call the decoder and the LM head apart, outside the root FSDP unit's
        forward, which all-gathers (and reduce-scatters the gradients of) the embeddings and the
        LM head; FSDP runs the full logits."""
        return None

    def autocast(self) -> AbstractContextManager:
        """FSDP2's mixed-precision policy casts the parameters: no autocast on top."""
        return nullcontext()

    def iter_full_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, full.detach()
