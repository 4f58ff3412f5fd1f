"""LocalPolicyWorker: a transformers causal LM in one process, unsharded.

For single-process runs, tests and small demos, and the reference the sharded backends are checked
against: the same training step and the same HF names, with no collective anywhere.

Precision (`bf16`): the parameters, their gradients and AdamW's state stay float32 (the master
copy); the forward and backward run under `torch.autocast` in bfloat16, so the activations (the
bulk of a step's memory at long sequences and large vocabularies) are half the size. Log-probabilities
are taken in float32 from the logits. `gradient_checkpointing`: each decoder layer's activations
are recomputed in the backward instead of kept (transformers' non-reentrant checkpointing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch

from inflight.config import Config
from inflight.train.batch import TrainBatch
from inflight.train.lora import adapter_tensors, apply_lora, lora_enabled, merged_tensors
from inflight.train.losses import LossFn, token_logprobs
from inflight.train.workers.base import PolicyWorker


def use_bf16(cfg: Config, device: torch.device) -> bool:
    """`trainer.bf16`, with null meaning: on CUDA."""
    return device.type == "cuda" if cfg.trainer.bf16 is None else cfg.trainer.bf16


class LocalPolicyWorker(PolicyWorker):
    """`AutoModelForCausalLM` from a local directory (`trainer.policy.model.path` or `model_path`)."""

    def __init__(
        self,
        cfg: Config,
        model_path: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        loss_fn: LossFn | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        bf16: bool | None = None,
        gradient_checkpointing: bool | None = None,
    ) -> None:
        """`bf16` and `gradient_checkpointing` default to `trainer.bf16` (null: true on CUDA) and
        `trainer.gradient_checkpointing`."""
        super().__init__(cfg, rank, world_size, loss_fn, device)
        self.model_path = model_path or cfg.trainer.policy.model.path
        if self.model_path is None:
            raise ValueError("no model: set trainer.policy.model.path or pass model_path")
        self.dtype = dtype
        self.bf16 = use_bf16(cfg, self.device) if bf16 is None else bf16
        self.gradient_checkpointing = (
            cfg.trainer.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
        )

    def load_hf_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=self.dtype)
        if self.gradient_checkpointing:
            model.config.use_cache = False
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model.to(self.device)

    def build_model(self) -> None:
        model = self.load_hf_model()
        self.model = apply_lora(model, self.cfg) if lora_enabled(self.cfg) else model

    def autocast(self) -> AbstractContextManager:
        """The forward's precision context: bfloat16 autocast when `bf16`, else nothing."""
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        with self.autocast():
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return token_logprobs(logits, batch.input_ids, self.temperature)

    def iter_full_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if lora_enabled(self.cfg):
            yield from merged_tensors(self.model)
            return
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def iter_sync_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return adapter_tensors(self.model) if lora_enabled(self.cfg) else self.iter_full_hf_tensors()
