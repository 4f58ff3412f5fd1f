"""DataTask: the seeded held-out split, prompt lengths (drop / refuse), rewards per row, environments."""

from __future__ import annotations

import json
import sys
import textwrap

import datasets
import pytest

from inflight.rewards import RewardError
from inflight.tasks import DatasetError, DataTask, make_char_tokenizer, reward_name, split_held_out

TOK = make_char_tokenizer()  # no chat template: prompts are their plain text, one token per character


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n, length=3):
    return [{"prompt": str(i).rjust(length, "0"), "answer": str(i)} for i in range(n)]


def test_split_holds_out_rows_never_trained_on(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(50))
    task = DataTask(TOK, [path], num_eval=200, val_fraction=0.1, seed=3)
    train, held = {p.id for p in task.train_problems()}, {p.id for p in task.eval_problems()}
    assert len(held) == 5 and len(train) == 45 and not train & held
    assert train | held == {f"d-{i}" for i in range(1, 51)}
    assert task.report.val_source == "split" and (task.report.train_rows, task.report.val_rows) == (45, 5)
    again = DataTask(TOK, [path], num_eval=200, val_fraction=0.1, seed=3)
    assert [p.id for p in again.eval_problems()] == [p.id for p in task.eval_problems()]  # deterministic
    other = DataTask(TOK, [path], num_eval=200, val_fraction=0.1, seed=4)
    assert {p.id for p in other.eval_problems()} != held
    assert len(DataTask(TOK, [path], num_eval=2).eval_problems()) == 2  # capped by num_eval
    assert "5 held-out split off the training data" in task.report.summary()


def test_split_needs_two_rows(tmp_path):
    with pytest.raises(DatasetError, match="too few to split"):
        split_held_out([], 10, 0.1, 0)
    path = _jsonl(tmp_path / "one.jsonl", _rows(1))
    with pytest.raises(DatasetError, match="give data.val_data"):
        DataTask(TOK, [path])
    assert len(DataTask(TOK, [path], [path]).eval_problems()) == 1  # with val_data it is fine


def test_long_prompts_dropped_and_counted(tmp_path):
    rows = _rows(6, 3) + [{"prompt": "1" * 40, "answer": "1"}, {"prompt": "2" * 41, "answer": "2"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    val = _jsonl(tmp_path / "v.jsonl", [{"prompt": "3" * 50, "answer": "1"}, {"prompt": "12", "answer": "2"}])
    task = DataTask(TOK, [path], [val], max_prompt_length=10)
    assert len(task.train_problems()) == 6 and [p.prompt for p in task.eval_problems()] == ["12"]
    assert task.report.dropped_long_prompts == {"train": 2, "val": 1}
    assert "dropped 3 prompts longer than 10 tokens" in task.report.summary()
    # the model's context lowers the limit: a prompt must leave room for one generated token
    assert DataTask(
        TOK, [path], [val], max_prompt_length=512, max_context=41
    ).report.dropped_long_prompts == {"train": 1, "val": 1}


def test_long_prompts_refused(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(3) + [{"prompt": "1" * 40, "answer": "1"}])
    with pytest.raises(
        DatasetError,
        match=r"d.jsonl:4: the prompt has 40 tokens, more than "
        r"trainer.max_prompt_length=10.*drop_long_prompts",
    ):
        DataTask(TOK, [path], [path], max_prompt_length=10, drop_long_prompts=False)


def test_every_prompt_dropped_fails_loudly(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1" * 40, "answer": "1"}] * 3)
    with pytest.raises(DatasetError, match=r"every train prompt is longer than.*shortest has 40 tokens"):
        DataTask(TOK, [path], max_prompt_length=10)


def test_rewards_per_row(tmp_path):
    path = tmp_path / "mixed.parquet"
    datasets.Dataset.from_list(
        [
            {"prompt": "1", "answer": "7", "env_class": None},
            {"prompt": "2", "answer": "7", "env_class": "gsm8k"},
            {"prompt": "3", "answer": "reasoning #### 7", "env_class": None},
        ]
    ).to_parquet(str(path))
    task = DataTask(TOK, [path], [path], env_class=None)
    a, b, c = task.eval_problems()
    assert [reward_name(p) for p in (a, b, c)] == ["exact", "gsm8k", "gsm8k"]  # row wins; `####` means gsm8k
    assert task.reward(a, " 7 ") == 1.0 and task.reward(a, "#### 7") == 0.0
    assert task.reward(b, "so #### 7") == 1.0 and task.reward(c, "#### 7.0") == 1.0
    assert task.report.rewards == {"exact": 2, "gsm8k": 4}
    contains = DataTask(TOK, [path], [path], env_class="contains")
    a, b, _ = contains.eval_problems()
    assert contains.reward(a, "it is 7") == 1.0 and contains.reward(b, "it is 7") == 0.0  # b keeps gsm8k
    assert task.make_env(a).step("7").reward == 1.0


def test_extra_info_reaches_the_reward(tmp_path):
    path = tmp_path / "re.parquet"
    datasets.Dataset.from_list(
        [
            {
                "prompt": "1",
                "env_class": "regex",
                "reward_spec": {"method": "rule", "ground_truth": "unused"},
                "extra_info": {"pattern": r"^\d+$"},
            }
        ]
    ).to_parquet(str(path))
    task = DataTask(TOK, [path], [path])
    (p,) = task.eval_problems()
    assert task.reward(p, "123") == 1.0 and task.reward(p, "12a") == 0.0


def test_unknown_rewards_fail_at_start_up(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(3))
    with pytest.raises(RewardError, match="environment.env_class='nope'"):
        DataTask(TOK, [path], env_class="nope")
    bad_row = _jsonl(tmp_path / "r.jsonl", [{"prompt": "1", "answer": "1", "env_class": "missing_mod:f"}])
    with pytest.raises(
        DatasetError, match=r"r.jsonl:1: column 'env_class'.*cannot import module 'missing_mod'"
    ):
        DataTask(TOK, [bad_row], [bad_row])


def test_user_environment_class_and_async_reward(tmp_path, monkeypatch):
    name = "data_task_user_env"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent("""
        import asyncio
        from inflight.tasks.base import Environment, StepResult

        class TwoTurns(Environment):
            max_turns = 2
            def __init__(self, problem):
                self.problem, self.turn = problem, 0
            def reset(self):
                return self.problem.prompt
            def step(self, response):
                self.turn += 1
                if self.turn == 1:
                    return StepResult("try again", 0.0, False)
                return StepResult(None, float(response == self.problem.answer), True)

        async def slow_exact(response, ground_truth, **extra):
            await asyncio.sleep(0)
            return float(response == ground_truth)

        class AsyncOneTurn(Environment):
            def __init__(self, problem):
                self.problem = problem
            def reset(self):
                return self.problem.prompt
            async def step(self, response):
                await asyncio.sleep(0)
                return StepResult(None, float(response == self.problem.answer), True)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        path = _jsonl(tmp_path / "d.jsonl", _rows(3))
        task = DataTask(TOK, [path], [path], env_class=f"{name}:TwoTurns")
        p = task.eval_problems()[1]
        env = task.make_env(p)
        assert type(env).__name__ == "TwoTurns" and env.max_turns == 2
        assert env.step("1").observation == "try again" and env.step("1").reward == 1.0
        import asyncio
        import inspect

        from inflight.rewards import score
        from inflight.tasks import environment_reward

        slow = DataTask(TOK, [path], [path], env_class=f"{name}:slow_exact")
        pending = slow.reward(p, "1")  # an awaitable: the caller's loop runs it, nothing blocks
        assert inspect.isawaitable(pending) and asyncio.run(pending) == 1.0
        assert asyncio.run(slow.score(p, "1")) == 1.0 and asyncio.run(slow.score(p, "2")) == 0.0
        assert asyncio.run(slow.make_env(p).step("1")).reward == 1.0  # SingleTurnEnv awaits it
        async_env = DataTask(TOK, [path], [path], env_class=f"{name}:AsyncOneTurn")
        assert asyncio.run(async_env.score(p, "1")) == 1.0 and asyncio.run(async_env.score(p, "0")) == 0.0
        assert asyncio.run(score(environment_reward(f"{name}:AsyncOneTurn"), "1", "1")) == 1.0
    finally:
        sys.modules.pop(name, None)


def test_chat_prompts_use_the_template(tiny_model_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_factory())
    path = tiny_model_factory() / "chat.jsonl"
    _jsonl(
        path,
        [
            {"prompt": "What is 1+1?", "answer": "2"},
            {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"},
        ],
    )
    task = DataTask(tok, [path], [path])
    for p in task.eval_problems():
        messages = [{"role": "user", "content": p.prompt}] if isinstance(p.prompt, str) else p.prompt
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert task.encode_prompt(p.prompt) == list(expected)
        assert p.meta["prompt_tokens"] == len(expected)
