"""The count_up task: running sums, problems, reward, long-tailed lengths, its tokenizer, its
selection by config, and the warm-up on it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.tasks import (
    BUILTIN_TASKS,
    AdditionTask,
    CountUpTask,
    build_base_model,
    make_builtin_task,
    make_char_tokenizer,
    warm_up,
)
from inflight.tasks.base_model import length_buckets, supervised_backward, supervised_batch
from inflight.tasks.count_up import make_problem, running_sums
from inflight.tasks.lengths import answer_length_stats, percentiles

SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256)


def test_running_sums_hand_computed():
    assert running_sums(7, 3, 30) == [10, 13, 16, 19, 22, 25, 28, 31]
    assert running_sums(5, 5, 10) == [10]  # stops at the first total >= b, equality included
    assert running_sums(0, 1, 1) == [1]
    assert running_sums(9, 4, 5) == [13]  # a >= b still takes one step
    with pytest.raises(ValueError, match="d=0"):
        running_sums(1, 0, 5)


def test_make_problem_prompt_answer_and_meta():
    p = make_problem("x", 7, 3, 30)
    assert p.prompt == "7+3<30=" and p.answer == "10,13,16,19,22,25,28,31"
    assert p.meta == {"a": 7, "d": 3, "b": 30, "terms": 8, "final": 31}


def test_reward_is_prefix_credit():
    task = CountUpTask(num_train=1)
    p = make_problem("x", 7, 3, 30)  # 10,13,16,19,22,25,28,31
    assert (
        task.reward(p, "10,13,16,19,22,25,28,31") == 1.0
        and task.reward(p, " 10,13,16,19,22,25,28,31 ") == 1.0
    )
    assert task.reward(p, "10,13,16,19") == 0.5  # stopped early: 4 of 8
    assert task.reward(p, "10,13,16,19,22,25,28,31,34,37") == 0.8  # ran past b: 8 of 10
    assert task.reward(p, "10,13,17,20,23,26,29,32") == 0.25  # a wrong sum: the 2 before it
    assert task.reward(p, "31") == 0.0 and task.reward(p, "") == 0.0  # no scratchpad, no credit
    assert task.reward(make_problem("y", 1, 1, 2), "2") == 1.0


def test_final_number_alone_is_not_enough():
    p = make_problem("x", 2, 2, 6)  # 4,6
    assert CountUpTask(num_train=1).reward(p, "4,5,6") < 1.0


def test_problems_are_consistent_held_out_and_deterministic():
    task = CountUpTask(num_train=3000, num_eval=200)
    train, evals = task.train_problems(), task.eval_problems()
    assert len(train) == 3000 and len({p.id for p in train}) == 3000 and len({p.prompt for p in evals}) == 200
    assert not {p.prompt for p in evals} & {p.prompt for p in train}
    for p in [*train[:300], *evals[:50]]:
        a, rest = p.prompt[:-1].split("+")
        d, b = rest.split("<")
        assert p.answer == ",".join(map(str, running_sums(int(a), int(d), int(b))))
        assert 0 <= int(a) <= task.max_start and 1 <= int(d) <= task.max_step
        assert 1 <= p.meta["terms"] <= task.max_terms and int(b) > int(a) + (p.meta["terms"] - 1) * int(d)
    assert {p.meta["terms"] for p in train} == set(range(1, task.max_terms + 1))
    assert CountUpTask(num_train=20).train_problems() == CountUpTask(num_train=20).train_problems()
    assert not {p.prompt for p in task.sample_problems(random.Random(1), 2000)} & {p.prompt for p in evals}


def test_answer_lengths_are_long_tailed_and_fit_max_new_tokens():
    task = CountUpTask(num_train=20_000)
    stats = answer_length_stats(task)
    assert stats["p99"] / stats["p50"] >= 4 and stats["max"] / stats["p50"] >= 6
    assert stats["max"] <= task.max_new_tokens
    longest = make_problem(
        "x", task.max_start, task.max_step, task.max_start + task.max_terms * task.max_step
    )
    assert (
        longest.meta["terms"] == task.max_terms
        and len(task.encode(longest.answer)) + 1 <= task.max_new_tokens
    )
    short = answer_length_stats(AdditionTask(num_train=5000))
    assert short["p99"] / short["p50"] < 2  # the addition task has no tail


def test_percentiles_nearest_rank():
    assert percentiles(list(range(1, 101))) == {
        "p50": 50.0,
        "p90": 90.0,
        "p99": 99.0,
        "max": 100.0,
        "mean": 50.5,
    }
    assert percentiles([3, 1, 2]) == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0, "mean": 2.0}
    assert percentiles([])["max"] == 0.0


def test_tokenizer_round_trip_keeps_shared_ids(tmp_path):
    tok = CountUpTask(num_train=1).tokenizer
    assert len(tok) == 16
    text = "7+3<30=10,13,16,19,22,25,28,31"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    base = make_char_tokenizer()
    assert base("0123456789+=", add_special_tokens=False)["input_ids"] == ids_of(tok, "0123456789+=")
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert ids_of(loaded, text) == ids and loaded.eos_token_id == 1 and loaded.pad_token_id == 0


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_registry_and_config_select_count_up():
    from inflight.train.defaults import task_overrides
    from inflight.train.main import resolve_config

    assert set(BUILTIN_TASKS) == {"addition", "chain_addition", "count_up"}
    task = make_builtin_task("count_up", num_train=5, seed=3)
    assert isinstance(task, CountUpTask) and task.seed == 3 and len(task.train_problems()) == 5
    with pytest.raises(ValueError, match="unknown built-in task"):
        make_builtin_task("subtraction")
    cfg, job = resolve_config(None, task_overrides("count_up"))
    assert job.task == "count_up"
    longest_prompt = max(len(task.encode(p.prompt)) for p in CountUpTask(num_train=2000).train_problems())
    assert cfg.generator.sampling_params.max_generate_length >= task.max_new_tokens
    assert cfg.generator.inference_engine.max_model_len >= longest_prompt + task.max_new_tokens


def test_length_buckets_only_for_long_tails():
    assert length_buckets([10, 11, 12, 10, 9, 12, 11, 10]) == [list(range(8))]
    groups = length_buckets([5, 60, 6, 5, 7, 5, 30, 6])
    assert sorted(i for g in groups for i in g) == list(range(8)) and len(groups) == 4
    assert groups[-1] == [6, 1]  # the longest two together


def test_bucketed_backward_matches_one_batch(tmp_path):
    task = CountUpTask(num_train=1)
    path = build_base_model(tmp_path / "m", tokenizer=task.tokenizer, **SMALL)
    problems = [
        make_problem(str(i), a, d, b)
        for i, (a, d, b) in enumerate(
            [(1, 2, 3), (4, 5, 6), (7, 1, 20), (3, 3, 50), (2, 9, 10), (0, 1, 1), (9, 9, 12), (1, 1, 2)]
        )
    ]
    lengths = [len(task.encode(p.prompt)) + len(task.encode(p.answer)) + 1 for p in problems]
    assert len(length_buckets(lengths)) > 1
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loss = supervised_backward(model, task, problems)
    bucketed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    whole = model(**supervised_batch(task, problems)).loss
    whole.backward()
    assert loss == pytest.approx(float(whole.detach()), rel=1e-5)
    for got, want in zip(bucketed, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_warm_up_runs_on_count_up(tmp_path):
    task = CountUpTask(num_train=10, num_eval=20)
    path = build_base_model(tmp_path / "m", tokenizer=task.tokenizer, **SMALL)
    assert AutoModelForCausalLM.from_pretrained(path).config.vocab_size == 16
    report = warm_up(path, task, steps=4, batch_size=32, max_seconds=60, target_accuracy=None, eval_every=2)
    assert report.steps == 4 and report.stopped_by == "steps" and report.loss < 3.0


def test_example_yaml_is_the_default_job_with_the_task_overrides():
    from inflight.config import dump_config
    from inflight.train.defaults import task_overrides
    from inflight.train.main import resolve_config

    root = Path(__file__).resolve().parents[2]
    cfg, job = resolve_config(str(root / "examples" / "count_up.yaml"), [])
    want_cfg, want_job = resolve_config(str(root / "examples" / "default.yaml"), task_overrides("count_up"))
    assert dump_config(cfg) == dump_config(want_cfg) and vars(job) == vars(want_job)
