"""What a step shows beside its metrics: the printed example, the dumped batch (read back with
`datasets`; a mixture-of-experts rollout's routing record checked against transformers' routers),
the process's memory, and which interval key prints."""

from __future__ import annotations

import asyncio

import datasets
import numpy as np
import torch
from moe_routing import hf_routing
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.client import LocalClient
from inflight.config import load_config
from inflight.engine import AsyncEngine, EngineConfig, LLMEngine
from inflight.engine.routing import decode_routed_experts
from inflight.rollout.task_generator import TaskGenerator, Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem, Task
from inflight.testing import make_tiny_model
from inflight.train.step_records import dump_batch, example_interval, format_example, memory_metrics


def _groups() -> list[TrajectoryGroup]:
    t = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -0.25], versions=[3, 4],
                   loss_mask=[1, 1], reward=1.0, finish_reason="stop")
    return [TrajectoryGroup(Problem("p7", "1+1=", "2"), [t, t])]


def test_the_dumped_batch_reads_back_with_datasets(tmp_path):
    path = dump_batch(_groups(), tmp_path, step=3)
    assert path == tmp_path / "dumped_data" / "step_3.jsonl"
    rows = datasets.load_dataset("json", data_files=str(path), split="train")
    assert rows.num_rows == 2 and rows[0]["prompt_id"] == "p7" and rows[0]["versions"] == [3, 4]
    assert rows[1]["logprobs"] == [-0.5, -0.25] and rows[1]["reward"] == 1.0


def test_the_dump_names_each_episode_and_why_its_harness_failed(tmp_path):
    ok = Trajectory([1, 2], [3], [-0.5], [0], [1], 1.0, "stop")
    failed = Trajectory([1, 2], [4], [-0.25], [0], [1], 0.0, "stop")
    failed.mark_rollout_failed("agent: RuntimeError: boom")
    groups = [TrajectoryGroup(Problem("p7", "1+1=", "2"), [ok, failed], epoch=2),
              TrajectoryGroup(Problem("q", "2+2=", "4"), [ok, ok], epoch=3)]
    rows = datasets.load_dataset("json", data_files=str(dump_batch(groups, tmp_path, step=1)), split="train")
    assert rows["episode_id"] == ["p7:2:0", "p7:2:1", "q:3:0", "q:3:1"]
    assert rows["rollout_error"] == [None, "agent: RuntimeError: boom", None, None]
    assert rows["loss_mask"][1] == [0] and rows["routed_experts"] == [None] * 4


class _Prompts(Task):
    """Two chat prompts, each episode one turn scored 0."""

    def train_problems(self):
        return [Problem(f"p{i}", [{"role": "user", "content": f"count to {i}"}], "") for i in range(2)]

    def eval_problems(self):
        return self.train_problems()

    def reward(self, problem, response):
        return 0.0

    def encode_prompt(self, prompt):
        return self.encode_chat(prompt)


def test_the_dumped_routing_record_reads_back_as_transformers_routes(tmp_path):
    model_dir = make_tiny_model(tmp_path / "moe", "qwen3_moe", seed=2)
    task = _Prompts(AutoTokenizer.from_pretrained(model_dir))

    async def play():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=128, block_size=4)))
        try:
            gen = TaskGenerator(
                LocalClient(engine), task, n=2, seed=3, max_tokens=6, return_routed_experts=True
            )
            return [await gen(p, epoch=1) for p in task.train_problems()]
        finally:
            await engine.close()

    groups = asyncio.run(play())
    rows = datasets.load_dataset("json", data_files=str(dump_batch(groups, tmp_path, step=2)), split="train")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trajectories = [t for g in groups for t in g.trajectories]
    assert rows["episode_id"] == ["p0:1:0", "p0:1:1", "p1:1:0", "p1:1:1"]
    for row, t in zip(rows, trajectories, strict=True):
        record, start = decode_routed_experts(row["routed_experts"])
        np.testing.assert_array_equal(record, t.routed_experts)
        tokens = row["prompt_ids"] + row["response_ids"]
        assert start == 0 and len(record) == len(tokens) - 1  # every position but the last sampled one
        np.testing.assert_array_equal(record, hf_routing(hf, tokens[:-1]))




def test_the_example_names_the_prompt_reward_and_decoded_tokens():
    text = format_example(_groups(), lambda ids: "".join(map(str, ids)), step=5)
    assert "[step 5]" in text and "p7" in text and "reward 1" in text and "'12'" in text and "'34'" in text


def test_memory_metrics_report_this_process():
    assert memory_metrics()["system/rss_gib"] > 0.01


def test_skyrls_old_example_interval_key_wins_when_set():
    assert example_interval(load_config(None, []).trainer) == 1  # SkyRL's default: every step
    assert example_interval(load_config(None, ["trainer.print_example_interval=0"]).trainer) == 0
    assert example_interval(load_config(None, ["trainer.log_example_interval=4"]).trainer) == 4
