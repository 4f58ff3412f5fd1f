"""What a training step shows beside its metrics: an example rollout printed
(`trainer.print_example_interval`), the batch written out (`trainer.dump_data_batch`), and the
process's memory (`trainer.enable_ray_gpu_monitor`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from inflight.config import TrainerConfig
from inflight.engine.routing import encode_routed_experts
from inflight.rollout.task_generator import TrajectoryGroup


def example_interval(trainer: TrainerConfig) -> int:
    """Steps between printed examples: `print_example_interval`, or SkyRL's older
    `log_example_interval` when that one is set (> 0); 0 or less: never."""
    return (
        trainer.log_example_interval if trainer.log_example_interval > 0 else trainer.print_example_interval
    )


def format_example(
    groups: Sequence[TrajectoryGroup], decode: Callable[[Sequence[int]], str], step: int
) -> str:
    """The first trajectory of the step: its prompt, response and reward, as the tokens decode."""
    t = groups[0].trajectories[0]
    return (f"[step {step}] example (prompt {groups[0].prompt_id}, reward {t.reward:g}, {t.finish_reason})\n"
            f"  prompt:   {decode(t.prompt_ids)!r}\n  response: {decode(t.response_ids)!r}")


def dump_batch(groups: Sequence[TrajectoryGroup], out_dir: str | Path, step: int) -> Path:
    """`<out_dir>/dumped_data/step_<step>.jsonl`: one line per trajectory, in the step's row order,
    with its episode's id (`TrajectoryGroup.episode_id`: prompt id, epoch, sample), its prompt's id,
    token ids, loss mask, rollout log-probabilities, weight versions, reward, finish reason, why the
    harness failed (`rollout_error`, null when it did not) and a mixture-of-experts rollout's routing
    record (`routed_experts`: `inflight.engine.routing.encode_routed_experts`' object, which
    `decode_routed_experts` reads back; null without one). The file reads back with
    `datasets.load_dataset("json", ...)`."""
    path = Path(out_dir) / "dumped_data" / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for group in groups:
            for sample, t in enumerate(group.trajectories):
                f.write(json.dumps({
                    "episode_id": group.episode_id(sample), "prompt_id": group.prompt_id,
                    "prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "loss_mask": t.loss_mask,
                    "logprobs": t.logprobs, "versions": t.versions, "reward": t.reward,
                    "finish_reason": t.finish_reason, "rollout_error": t.info.get("rollout_error"),
                    "routed_experts": encode_routed_experts(t.routed_experts, t.routed_experts_start),
                }) + "\n")
    return path


def memory_metrics() -> dict[str, float]:
    """`system/rss_gib` (this process's resident memory) and, on CUDA, `system/cuda_allocated_gib`
    and `system/cuda_reserved_gib`."""
    out: dict[str, float] = {}
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["system/rss_gib"] = int(line.split()[1]) / 2**20
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["system/cuda_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        out["system/cuda_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    return out
