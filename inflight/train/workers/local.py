"""LocalPolicyWorker: a transformers causal LM in one process, unsharded.

For single-process runs, tests and small demos, and the reference the sharded backends are checked
against: the same training step and the same HF names, with no collective anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from inflight.config import Config
from inflight.train.batch import TrainBatch
from inflight.train.losses import LossFn, token_logprobs
from inflight.train.workers.base import PolicyWorker


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
    ) -> None:
        super().__init__(cfg, rank, world_size, loss_fn, device)
        self.model_path = model_path or cfg.trainer.policy.model.path
        if self.model_path is None:
            raise ValueError("no model: set trainer.policy.model.path or pass model_path")
        self.dtype = dtype

    def load_hf_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.model_path), dtype=self.dtype)
        return model.to(self.device)

    def build_model(self) -> None:
        self.model = self.load_hf_model()

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return token_logprobs(logits, batch.input_ids, self.temperature)

    def iter_full_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()
