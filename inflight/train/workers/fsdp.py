"""FSDPPolicyWorker: a transformers causal LM sharded with FSDP2 (`fully_shard`).

Each decoder layer is its own FSDP unit and the root holds the rest (embeddings, final norm, LM
head). Training is the base class's micro-batched step (FSDP2 all-gathers parameters for the
forward and reduce-scatters averaged gradients); AdamW steps on the local shards. For a weight
sync every parameter is gathered to a full tensor (`DTensor.full_tensor()`, one all-gather per
parameter, in `named_parameters()` order on every rank, so memory never holds more than one full
parameter beyond the shards); the names are the Hugging Face ones, which FSDP2 keeps unchanged.

`fsdp_config.fsdp_size` (SkyRL's): -1 (or the world size or more) shards every parameter over all
ranks; a smaller size S is hybrid sharding (HSDP), FSDP2 over a 2-D device mesh
(world / S replicas, each sharded over S ranks): gradients are reduce-scattered within a replica and
all-reduced across replicas, so the step is the same average over every rank's data.

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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from inflight.config import ConfigError, Violation
from inflight.train.lora import lora_enabled
from inflight.train.workers.local import PRECISIONS, LocalPolicyWorker


class FSDPPolicyWorker(LocalPolicyWorker):
    """One FSDP2 rank. Same constructor as `LocalPolicyWorker`; `rank`/`world_size` default to
    torch.distributed's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if lora_enabled(self.cfg):
            raise ConfigError(
                [
                    Violation(
                        "trainer.policy.model.lora.rank",
                        self.cfg.trainer.policy.model.lora.rank,
                        "LoRA on FSDP ranks is not implemented yet",
                        "run one policy rank (the local worker), or set lora.rank=0",
                    )
                ]
            )
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def build_model(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FSDPPolicyWorker needs torch.distributed initialised (init_process_group)")
        model = self.load_hf_model()
        options = self.shard_options()
        for unit in self.wrapped_units(model):
            fully_shard(unit, **options)
        fully_shard(model, **options)
        self.model = model

    def shard_options(self) -> dict:
        """`fully_shard`'s options from `fsdp_config`: the device mesh (`fsdp_size`), the mixed
        precision (under `bf16`), where parameters wait (`cpu_offload`, on CUDA) and
        `reshard_after_forward`."""
        fsdp = self.section.fsdp_config
        options: dict = {"reshard_after_forward": fsdp.reshard_after_forward}
        mesh = self.hybrid_mesh()
        if mesh is not None:
            options["mesh"] = mesh
        if self.bf16:
            mp = fsdp.mixed_precision
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=PRECISIONS[mp.param_dtype],
                                                        reduce_dtype=PRECISIONS[mp.reduce_dtype])
        if fsdp.cpu_offload and self.device.type == "cuda":
            options["offload_policy"] = CPUOffloadPolicy()
        return options

    def hybrid_mesh(self) -> DeviceMesh | None:
        """The (replicas, fsdp_size) mesh of hybrid sharding, or None: shard over every rank
        (`fsdp_size` -1, or the world size or more, as SkyRL's `create_device_mesh`)."""
        size = self.section.fsdp_config.fsdp_size
        if size < 0 or size >= self.world_size:
            return None
        if size == 0 or self.world_size % size:
            raise ConfigError(
                [
                    Violation(
                        f"trainer.{self.role}.fsdp_config.fsdp_size",
                        size,
                        f"must divide the "
                        f"{self.world_size} ranks (each replica is sharded over fsdp_size of them)",
                        "set a divisor of the ranks, or -1 (shard over all of them)",
                    )
                ]
            )
        return init_device_mesh(
            self.device.type, (self.world_size // size, size), mesh_dim_names=("ddp", "fsdp")
        )

    def wrapped_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules sharded as one unit each: those whose class `fsdp_config.wrap_policy`'s
        `transformer_layer_cls_to_wrap` names, else each decoder layer."""
        names = self.section.fsdp_config.wrap_policy.get("transformer_layer_cls_to_wrap")
        # a causal or vision-language model's decoder (a VLM's: its language model's); a critic's backbone
        layers = (model.get_decoder() if hasattr(model, "get_decoder") else model.model).layers
        if not names:
            return list(layers)
        names = [names] if isinstance(names, str) else list(names)
        units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not units:
            raise ConfigError(
                [
                    Violation(
                        f"trainer.{self.role}.fsdp_config.wrap_policy",
                        names,
                        "names no module class of the model",
                        f"use one of its classes, e.g. {type(layers[0]).__name__}",
                    )
                ]
            )
        return units

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

    @torch.no_grad()
    def load_hf_state(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the shards from full HF-named tensors, each cut as its parameter is sharded
        (a collective: every rank gives the same tensors in the same order)."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"{name!r} is not a parameter of the {self.role} model")
            param = params[name]
            if isinstance(param, DTensor):
                full = tensor.to(param.device, param.dtype)
                param.to_local().copy_(
                    distribute_tensor(full, param.device_mesh, param.placements).to_local()
                )
            else:
                param.copy_(tensor)
