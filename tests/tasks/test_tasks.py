"""The built-in task, the character tokenizer, JSONL datasets and the environment interface."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from inflight.tasks import (
    AdditionTask,
    ChainAdditionEnv,
    ChainAdditionTask,
    DatasetError,
    JsonlTask,
    Problem,
    SingleTurnEnv,
    load_jsonl,
    make_char_tokenizer,
)


def test_char_tokenizer_has_14_tokens_and_round_trips(tmp_path):
    tok = make_char_tokenizer()
    assert len(tok) == 14
    ids = tok("123+45=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and tok.decode(ids) == "123+45="
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "123+45="
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (
        loaded("9+9=", add_special_tokens=False)["input_ids"]
        == tok("9+9=", add_special_tokens=False)["input_ids"]
    )
    assert loaded.eos_token_id == tok.eos_token_id == 1 and loaded.pad_token_id == 0
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == "1+2=3<eos>"
    assert loaded.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True) == "1+2="


def test_addition_problems_held_out_and_rewards():
    task = AdditionTask(num_train=2000, num_eval=200)
    evals, train = task.eval_problems(), task.train_problems()
    assert len(evals) == 200 and len({p.prompt for p in evals}) == 200
    assert len(train) == 2000 and len({p.id for p in train}) == 2000
    assert not {p.prompt for p in evals} & {p.prompt for p in train}
    for p in train[:50]:
        a, b = p.prompt[:-1].split("+")
        assert p.answer == str(int(a) + int(b)) and 1 <= len(a) <= 3 and 1 <= len(b) <= 3
    digits = {len(p.prompt.split("+")[0]) for p in train}
    assert digits == {1, 2, 3}
    p = Problem("x", "12+30=", "42")
    assert task.reward(p, "42") == 1.0 and task.reward(p, "43") == 0.0 and task.reward(p, "420") == 0.0
    assert AdditionTask(num_train=10).train_problems() == AdditionTask(num_train=10).train_problems()


def test_too_many_eval_problems_is_an_error():
    with pytest.raises(ValueError, match="num_eval"):
        AdditionTask(max_digits=1, num_eval=60).eval_problems()


def test_single_turn_env():
    task = AdditionTask(num_train=1)
    env = task.make_env(Problem("x", "1+1=", "2"))
    assert isinstance(env, SingleTurnEnv) and env.reset() == "1+1="
    result = env.step("2")
    assert result.done and result.reward == 1.0 and result.observation is None


def test_chain_addition_env_turns():
    env = ChainAdditionEnv(Problem("x", "2+3=", "5"), [4, 1])
    assert env.reset() == "2+3=" and env.max_turns == 3
    r1 = env.step("5")
    assert not r1.done and r1.observation == "+4=" and r1.reward == pytest.approx(1 / 3)
    r2 = env.step("9")
    assert not r2.done and r2.observation == "+1="
    r3 = env.step("10")
    assert r3.done and r3.reward == pytest.approx(1 / 3)
    env.reset()
    wrong = env.step("6")
    assert wrong.done and wrong.reward == 0.0
    task = ChainAdditionTask(num_train=5, turns=3)
    assert task.make_env(task.train_problems()[0]).max_turns == 3


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [
        {"prompt": "What is 2+2?", "answer": 4},
        {"id": "q2", "prompt": [{"role": "user", "content": "Hi"}], "answer": "hello"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = load_jsonl(path)
    assert [p.id for p in problems] == ["data-1", "q2"] and problems[0].answer == "4"
    assert problems[1].prompt == [{"role": "user", "content": "Hi"}]
    tok = make_char_tokenizer()
    task = JsonlTask(tok, path, num_eval=1, match="contains")
    assert len(task.eval_problems()) == 1 and len(task.train_problems()) == 1
    assert task.reward(problems[1], "oh hello there") == 1.0
    assert JsonlTask(tok, path, num_eval=1).reward(problems[1], "oh hello there") == 0.0
    digits = tmp_path / "digits.jsonl"
    digits.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    assert (
        JsonlTask(tok, digits, num_eval=1).encode_prompt("1+2=")
        == tok("1+2=", add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ('{"prompt": "x"}', "'prompt' and 'answer'"),
        ('{"prompt": 3, "answer": 1}', "string or a list of chat messages"),
        ('{"id": 1, "prompt": "a", "answer": 1}\n{"id": 1, "prompt": "b", "answer": 2}', "duplicate id"),
        ("", "holds no problems"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message):
        load_jsonl(path)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_sample_problems_for_the_warm_up():
    import random

    task = AdditionTask(num_train=50)
    pairs = task.sample_pairs(random.Random(5), 20)
    problems = task.sample_problems(random.Random(5), 20)
    assert [p.prompt for p in problems] == [f"{a}+{b}=" for a, b in pairs]  # the warm-up's data as before
    assert all(p.answer == str(a + b) for p, (a, b) in zip(problems, pairs, strict=True))

    from inflight.tasks import Task

    class Fixed(AdditionTask):
        sample_problems = Task.sample_problems  # the default: draws from the training problems

    fixed = Fixed(num_train=30)
    drawn = fixed.sample_problems(random.Random(1), 100)
    assert len(drawn) == 100 and set(drawn) <= set(fixed.train_problems())
