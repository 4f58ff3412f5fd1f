"""The critic of `advantage_estimator=gae` (SkyRL: `trainer.critic.*`): a value model, the
transformers backbone of `trainer.critic.model.path` with a linear value head, trained by the
clipped value loss (`inflight.algorithms.value_loss`) before the policy in every step.

`ValueModel` names its parameters as a causal LM checkpoint names the backbone's (`model.*`) plus the
head (`<value_head_prefix>.weight`, [1, hidden], no bias, as SkyRL's), so a saved critic loads back
through `AutoModel` and its head from the same safetensors. A checkpoint without that head (a
policy's) gets a fresh one, drawn as SkyRL draws it: normal with std 1 / (hidden + 1).

Values are aligned with log-probabilities: `values[b, t]` is the head on the hidden state before
token t (the state token t is the action of); position 0 is 0. The critic runs beside the policy on
its ranks, with the policy's worker code (`LocalCriticWorker`, `FSDPCriticWorker`); megatron has
no critic (refused by `inflight.config.implemented`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from inflight.algorithms import masked_mean, value_loss
from inflight.train.batch import TrainBatch
from inflight.train.workers.fsdp import FSDPPolicyWorker
from inflight.train.workers.local import LocalPolicyWorker, attention_implementation


@dataclass
class CriticBatch(TrainBatch):
    """What the critic trains on: `old_values` [B, T] (its values when the step started, the ones GAE
    used) and `returns` [B, T] (GAE's), with the loss mask of the policy's tokens."""

    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


class ValueModel(nn.Module):
    """A transformers backbone (`model`) and a linear value head named `head_name`."""

    def __init__(self, backbone: nn.Module, head_name: str) -> None:
        super().__init__()
        if not head_name.isidentifier() or head_name == "model":
            raise ValueError(f"trainer.algorithm.value_head_prefix={head_name!r} must be a Python name other "
                             "than 'model' (it names the value head's parameter)")
        self.model = backbone
        self.config = backbone.config
        self.head_name = head_name
        setattr(self, head_name, nn.Linear(backbone.config.hidden_size, 1, bias=False))

    @property
    def head(self) -> nn.Linear:
        return getattr(self, self.head_name)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] float32 values, `values[b, t]` from the hidden state at t - 1 (0 at t = 0)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        values = self.head(hidden).squeeze(-1).float()
        return F.pad(values[:, :-1], (1, 0))


def read_head(model_dir: str | Path, head_name: str) -> torch.Tensor | None:
    """`<head_name>.weight` from a directory's safetensors files, or None when none holds it."""
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if f"{head_name}.weight" in handle.keys():
                return handle.get_tensor(f"{head_name}.weight")
    return None


class CriticMixin:
    """What turns a policy worker class into a critic worker: the value model instead of the causal
    LM, values instead of log-probabilities, the value loss in the training pass."""

    def load_hf_model(self) -> nn.Module:
        """The backbone of the critic's checkpoint (config overridden by `trainer.critic.model_config_kwargs`)
        with the value head: the checkpoint's `value_head_prefix` weights, else SkyRL's initialisation."""
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(str(self.model_path), **self.section.model_config_kwargs)
        backbone = AutoModel.from_pretrained(
            str(self.model_path),
            config=config,
            dtype=torch.float32,
            attn_implementation=attention_implementation(self.cfg, self.device),
        )
        if self.gradient_checkpointing:
            backbone.config.use_cache = False
            reentrant = self.cfg.trainer.gradient_checkpointing_use_reentrant
            backbone.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": reentrant}
            )
        model = ValueModel(backbone, self.cfg.trainer.algorithm.value_head_prefix)
        saved = read_head(self.model_path, model.head_name)
        with torch.no_grad():
            if saved is not None:
                model.head.weight.copy_(saved.reshape(model.head.weight.shape))
            else:
                gen = torch.Generator().manual_seed(self.cfg.trainer.seed)
                std = 1.0 / (config.hidden_size + 1)
                model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=gen) * std)
        return model.to(self.device)

    def compute_logprobs(self, batch: TrainBatch, entropy: bool = False) -> torch.Tensor:
        raise TypeError("a critic gives values (compute_values), not log-probabilities")

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] values of `batch` with gradients."""
        with self.autocast():
            return self.model(batch.input_ids, batch.attention_mask)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] values without gradients (the step's old values)."""
        self.model.eval()
        return self.compute_values(batch.to(self.device)).detach()

    def forward_backward(self, batch: CriticBatch, scale: float) -> dict[str, float]:
        """Accumulate the gradient of `scale` times the clipped value loss (`trainer.algorithm.value_clip`)
        of `batch`; returns its metrics."""
        values = self.compute_values(batch)
        loss, clipfrac = value_loss(values, batch.old_values, batch.returns, batch.loss_mask,
                                    self.cfg.trainer.algorithm.value_clip)
        (loss * scale).backward()
        out = {
            "critic_loss": float(loss.detach()),
            "values_mean": float(masked_mean(values.detach(), batch.loss_mask)),
        }
        if clipfrac is not None:
            out["values_clipfrac"] = float(clipfrac)
        return out


class LocalCriticWorker(CriticMixin, LocalPolicyWorker):
    """The critic in one process (`trainer.critic.*`: model, optimizer_config, model_config_kwargs)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("role", "critic")
        super().__init__(*args, **kwargs)


class FSDPCriticWorker(CriticMixin, FSDPPolicyWorker):
    """The critic as one FSDP2 rank (each backbone layer a unit, `trainer.critic.fsdp_config`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("role", "critic")
        super().__init__(*args, **kwargs)
