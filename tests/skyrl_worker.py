"""SkyRL 0.3.0's own policy worker (`PolicyWorkerBase.forward_backward`: its micro-batching, the loss it
builds from the policy loss, the KL and the entropy terms, the metrics it logs) run on one mini-batch on
one CPU rank, its model a `TokenTable`: per-token log-probabilities and entropies as parameters, so the
gradients SkyRL's reduction puts on them can be compared with ours.

Only the process plumbing around the worker is stood in for (one rank: the backward is
`loss.backward()`, the all-reduce the identity; `torch.cuda.current_device` answers "cpu")."""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from oracle_import import import_oracle


class TokenTable(torch.nn.Module):
    """A 'policy' whose log-probabilities and entropies of row r are parameters' row r; a micro-batch
    names its rows in `sequences[:, 0]`. The entropy comes back over one more position than the
    response, as SkyRL's models give it (the worker reads `entropy[:, -num_actions - 1 : -1]`)."""

    def __init__(self, log_probs: torch.Tensor, entropy: torch.Tensor) -> None:
        super().__init__()
        self.log_probs = torch.nn.Parameter(log_probs.clone())
        self.entropy = torch.nn.Parameter(entropy.clone())

    def forward(self, sequences: torch.Tensor, num_actions: int, *, entropy_requires_grad: bool = False,
                **_: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = sequences[:, 0]
        entropy = self.entropy[rows] if entropy_requires_grad else self.entropy[rows].detach()
        return self.log_probs[rows], {"entropy": F.pad(entropy, (0, 1))}


def skyrl_forward_backward(monkeypatch, table: TokenTable, algorithm: Any, micro_batch_size: int,
                           **tensors: torch.Tensor) -> dict[str, float]:
    """SkyRL's `forward_backward` over the table's rows as one mini-batch, `micro_batch_size` rows per
    micro-batch; `tensors`: `advantages`, `loss_mask`, `action_log_probs` (old), and optionally
    `base_action_log_probs` (reference), `rollout_logprobs`, all [B, R]. Leaves the gradients on the
    table; returns SkyRL's metrics."""
    worker_module = import_oracle("skyrl.backends.skyrl_train.workers.worker")
    batch_module = import_oracle("skyrl.backends.skyrl_train.training_batch")
    ppo = import_oracle("skyrl.backends.skyrl_train.utils.ppo_utils")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    rows, width = tensors["loss_mask"].shape
    data = batch_module.TrainingInputBatch({
        "sequences": torch.arange(rows)[:, None].expand(rows, width + 1).clone(),
        "attention_mask": torch.ones(rows, width + 1, dtype=torch.long),
        "response_mask": torch.ones(rows, width, dtype=torch.long),
        **tensors,
    })
    data.metadata = {"response_length": width}
    worker = SimpleNamespace(
        cfg=SimpleNamespace(micro_train_batch_size_per_gpu=micro_batch_size, max_tokens_per_microbatch=-1,
                            algorithm=algorithm),
        model=table,
        policy_loss_fn=ppo.PolicyLossRegistry.get(algorithm.policy_loss_type),
        mesh_rank=SimpleNamespace(dp_size=1),
        strategy=SimpleNamespace(backward=lambda loss, model, optimizer: loss.backward(),
                                 all_reduce=lambda metrics, op, group=None: dict(metrics)),
        optimizer=None,
        scheduler=SimpleNamespace(get_last_lr=lambda: [0.0]),
        device_mesh=SimpleNamespace(get_group=lambda name: None),
    )
    base = worker_module.PolicyWorkerBase
    worker._forward_backward_micro = functools.partial(base._forward_backward_micro, worker)
    with warnings.catch_warnings():  # its bf16 autocast for CUDA, off on CPU
        warnings.filterwarnings("ignore", message="CUDA is not available", category=UserWarning)
        return base.forward_backward(worker, data).metrics
