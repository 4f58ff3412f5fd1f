"""What a step shows beside its metrics: the printed example, the dumped batch (read back with
`datasets`), the process's memory, and which interval key prints."""

from __future__ import annotations

import datasets

from inflight.config import load_config
from inflight.rollout.generator import Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem
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


def test_the_example_names_the_prompt_reward_and_decoded_tokens():
    text = format_example(_groups(), lambda ids: "".join(map(str, ids)), step=5)
    assert "[step 5]" in text and "p7" in text and "reward 1" in text and "'12'" in text and "'34'" in text


def test_memory_metrics_report_this_process():
    assert memory_metrics()["system/rss_gib"] > 0.01


def test_skyrls_old_example_interval_key_wins_when_set():
    assert example_interval(load_config(None, []).trainer) == 1  # SkyRL's default: every step
    assert example_interval(load_config(None, ["trainer.print_example_interval=0"]).trainer) == 0
    assert example_interval(load_config(None, ["trainer.log_example_interval=4"]).trainer) == 4
