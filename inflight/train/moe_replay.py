"""Routing replay ("R3") in the training forward of a transformers mixture-of-experts model.

transformers' sparse MoE blocks (`Qwen3MoeSparseMoeBlock`, `Qwen2MoeSparseMoeBlock`) flatten the
hidden states [B, S, H] to [B * S, H] (row b * S + s) and ask their router (`Qwen3MoeTopKRouter` /
`Qwen2MoeTopKRouter`) for `(router_logits, scores, indices)`, then run `experts(x, indices, scores)`
whatever the experts implementation. One forward hook per router is therefore the whole replay:
where the batch carries the rollout's routing record (`TrainBatch.routed_experts`, [B, S, MoE
layers, top_k], -1 where a position has none), the hook returns the recorded indices, with the gates
the current router gives them (`softmax` in float32 over its own logits, gathered at the recorded
experts, renormalised when `norm_topk_prob`), so the router still gets a gradient. Positions
without a record (padding, the last position of a row, tokens after the record) keep the router's
own choice. Routers are found by class over `named_modules()`, so a peft- or FSDP-wrapped model
is hooked alike; the j-th router is the j-th sparse layer, as in the engine's record.

The same hooks count, in the training forwards (gradients on), the tokens whose routing differs
from the rollout's in any layer: the experts the forward used (`used_differs`: 0 with replay) and
the router's own top-k (`router_differs`: how far the trainer's router has moved from the one that
routed the rollout). `inflight.train.moe_metrics` turns the counts into the step's metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from inflight.config import Config, ConfigError, Violation

REPLAY_KEY = "trainer.{role}.megatron_config.moe_enable_routing_replay"
FREEZE_KEY = "trainer.policy.megatron_config.freeze_moe_router"


def router_classes() -> tuple[type, ...]:
    """transformers' MoE router classes whose output the replay replaces."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return Qwen3MoeTopKRouter, Qwen2MoeTopKRouter


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (empty for a dense model)."""
    classes = router_classes()
    return [m for _, m in model.named_modules() if isinstance(m, classes)]


def replay_enabled(cfg: Config, role: str) -> bool:
    """Whether the `role` worker replays the rollout's routing (`trainer.<role>.megatron_config.
    moe_enable_routing_replay`; the critic never does: it has no such key)."""
    section = getattr(cfg.trainer, role, None)
    megatron = getattr(section, "megatron_config", None)
    return bool(megatron is not None and megatron.moe_enable_routing_replay)


class RoutingReplay:
    """The forward hooks on a model's routers: replay (when `replay`) and the routing counts.

    `prepare(batch)` before each forward says which record the next forwards replay (None: none);
    it stays in force until the next `prepare`, so the recomputation of a checkpointed layer in the
    backward replays the same experts as its forward.
    """

    def __init__(self, routers: list[nn.Module], replay: bool) -> None:
        self.routers, self.replay = routers, replay
        self.counts = {"tokens": 0, "used_differs": 0, "router_differs": 0}
        self._rows: torch.Tensor | None = None
        self._counted: torch.Tensor | None = None  # [B * S] positions counted (training forwards)
        self._differs: dict[str, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(partial(self._hook, j)) for j, r in enumerate(routers)]

    def prepare(self, batch: Any, count: bool | None = None) -> None:
        """Replay `batch.routed_experts` (if any) in the forwards that follow; count their routing when
        `count` (default: gradients are on, i.e. a training forward) on the rows with tokens to train on."""
        self._flush()
        rows = getattr(batch, "routed_experts", None)
        if rows is None:
            if self.replay:
                raise ValueError(
                    "routing replay is on but the batch carries no routing record: the rollout must "
                    "ask the engines for it (generator.inference_engine.enable_return_routed_experts"
                    "=true)"
                )
            self._rows = None
            return
        b, s = batch.input_ids.shape
        if tuple(rows.shape[:3]) != (b, s, len(self.routers)):
            raise ValueError(f"routed_experts has shape {tuple(rows.shape)}, expected [{b}, {s}, "
                             f"{len(self.routers)} MoE layers, top_k] (the batch's rows and positions)")
        self._rows = rows.reshape(b * s, *rows.shape[2:])
        if count if count is not None else torch.is_grad_enabled():
            live = (batch.loss_mask.sum(dim=1, keepdim=True) > 0).expand(b, s).reshape(-1)
            self._counted = live & (self._rows[:, 0, 0] >= 0)
            self._differs = {
                key: torch.zeros_like(self._counted) for key in ("used_differs", "router_differs")
            }

    def take_counts(self) -> dict[str, int]:
        """The counts since the last call (tokens counted, and of them those whose routing differed
        from the record in some layer: the experts used, the router's own choice); resets them."""
        self._flush()
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts

    @contextmanager
    def replaying(self, on: bool) -> Iterator[None]:
        """Replay (or not) in the forwards inside, whatever the run's setting."""
        before, self.replay = self.replay, on
        try:
            yield
        finally:
            self.replay = before

    def remove(self) -> None:
        """Take the hooks off the routers."""
        for handle in self._handles:
            handle.remove()

    def _flush(self) -> None:
        if self._counted is not None:
            self.counts["tokens"] += int(self._counted.sum())
            for key, differs in self._differs.items():
                self.counts[key] += int(differs.sum())
        self._counted, self._differs = None, {}

    def _hook(self, layer: int, router: nn.Module, args: tuple, output: tuple) -> tuple | None:
        if self._rows is None:
            return None
        logits, _, own = output
        if self._rows.shape[0] != own.shape[0]:
            raise RuntimeError(
                f"the router of MoE layer {layer} saw {own.shape[0]} tokens, the routing record "
                f"covers {self._rows.shape[0]} (batch x positions): replay needs the padded batch"
            )
        recorded = self._rows[:, layer].to(own.device, torch.long)
        has = recorded[:, 0] >= 0
        used = torch.where(has[:, None], recorded, own) if self.replay else own
        if self._counted is not None:
            counted = self._counted.to(own.device)
            self._differs["router_differs"] |= (counted & _differs(own, recorded)).to(self._counted.device)
            self._differs["used_differs"] |= (counted & _differs(used, recorded)).to(self._counted.device)
        if not self.replay:
            return None
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        gates = probs.gather(-1, used)
        if router.norm_topk_prob:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return logits, gates.to(logits.dtype), used


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] whether two [T, k] expert sets differ (order within a token's slots does not count)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def attach_routing(model: nn.Module, cfg: Config, role: str) -> RoutingReplay | None:
    """The replay hooks on `model`'s routers for the `role` worker (None for a dense model), and
    `freeze_moe_router` for the policy (its routers' parameters get no gradient). Raises
    ConfigError when replay is asked of a model without MoE layers."""
    routers = moe_routers(model)
    replay = replay_enabled(cfg, role)
    if not routers:
        if replay:
            key = REPLAY_KEY.format(role=role)
            raise ConfigError(
                [
                    Violation(
                        key,
                        True,
                        f"{type(model).__name__} has no mixture-of-experts router to replay",
                        f"set {key}=false, or train a Qwen3-MoE / Qwen2-MoE model",
                    )
                ]
            )
        return None
    if role == "policy" and cfg.trainer.policy.megatron_config.freeze_moe_router:
        for router in routers:
            router.requires_grad_(False)
    return RoutingReplay(routers, replay)


__all__ = ["RoutingReplay", "attach_routing", "moe_routers", "replay_enabled", "router_classes"]
