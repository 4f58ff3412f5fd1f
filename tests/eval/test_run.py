"""The evaluation runner without an engine: a scripted generator whose groups finish in reverse
order, bounded concurrency, the summary of hand-made rewards, and held-out sets named by file."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from inflight.eval.run import dataset_names, eval_sets, evaluate
from inflight.tasks.base import Problem
from inflight.tasks.data_task import DataTask

REWARDS = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0], "c": [1.0, 1.0, 1.0, 0.5]}


def scripted(delay_order: list[str], gate_seen: list[int]):
    running = 0

    async def generate(problem: Problem):
        nonlocal running
        running += 1
        gate_seen.append(running)
        await asyncio.sleep(0.001 * (len(delay_order) - delay_order.index(problem.id)))
        running -= 1
        trajs = [SimpleNamespace(reward=r, response_ids=[i, 7], finish_reason="length" if i == 3 else "stop",
                                 num_generated=2) for i, r in enumerate(REWARDS[problem.id])]
        return SimpleNamespace(trajectories=trajs)

    return generate


def test_records_come_in_problem_order_and_summarise_by_hand():
    seen: list[int] = []
    sets = {"first": [Problem("a", "pa", "x"), Problem("b", "pb", "y")], "second": [Problem("c", "pc", "z")]}
    result = asyncio.run(evaluate(scripted(["a", "b", "c"], seen), sets, lambda ids: f"r{ids[0]}", n=4,
                                  concurrency=2))
    assert max(seen) <= 2
    assert [(s["data"], s["problem_id"], s["sample"]) for s in result.samples] == \
        [("first", "a", i) for i in range(4)] + [("first", "b", i) for i in range(4)] + \
        [("second", "c", i) for i in range(4)]
    first = result.metrics["first"]
    # a: 2 of 4 correct -> pass@1 1/2, pass@2 1 - C(2,2)/C(4,2) = 5/6, pass@4 1; b: 0 correct
    assert first["pass@1"] == pytest.approx(0.25) and first["pass@2"] == pytest.approx(5 / 12)
    assert first["pass@4"] == pytest.approx(0.5) and first["mean_reward"] == pytest.approx(2 / 8)
    assert first["truncated_fraction"] == pytest.approx(0.25) and first["num_problems"] == 2
    second = result.metrics["second"]  # 0.5 is not correct: 3 of 4
    assert second["pass@1"] == pytest.approx(0.75) and second["pass@2"] == pytest.approx(1.0)
    assert result.accuracy == pytest.approx((0.5 + 0 + 0.75) / 3)
    logged = result.log_metrics()
    assert logged["eval/second/pass@4"] == 1.0 and logged["eval/accuracy"] == result.accuracy
    assert result.samples[0]["response"] == "r0" and result.samples[0]["ground_truth"] == "x"
    json.dumps(result.samples)  # the dump is plain JSON


def test_a_generator_returning_the_wrong_count_is_an_error():
    with pytest.raises(RuntimeError, match="expected n=3"):
        asyncio.run(evaluate(scripted(["a"], []), {"s": [Problem("a", "p", "x")]}, str, n=3))
    with pytest.raises(ValueError, match="hold no problems"):
        asyncio.run(evaluate(scripted(["a"], []), {"s": []}, str, n=4))


def test_held_out_sets_are_named_by_their_files(tiny_model_factory, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_factory("qwen2"))
    files = {}
    for name, rows in (("train", 4), ("math_test", 3), ("gsm_test", 2)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"prompt": f"{name} {i}", "answer": str(i)}) + "\n"
                                       for i in range(rows)))
    task = DataTask(tokenizer, [files["train"]], [files["math_test"], files["gsm_test"]])
    sets = eval_sets(task)
    assert list(sets) == ["math_test", "gsm_test"] and [len(v) for v in sets.values()] == [3, 2]
    assert [len(v) for v in eval_sets(task, limit=1).values()] == [1, 1]
    assert dataset_names(["a/test.parquet", "b/test.parquet", "c/train.jsonl"]) == \
        {"a/test.parquet": "a/test", "b/test.parquet": "b/test", "c/train.jsonl": "train"}
