"""Every data format loads through `load_problems`, compared with what pyarrow itself reads."""

from __future__ import annotations

import json

import datasets
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import pytest

from inflight.tasks.dataset import DatasetError, load_jsonl, load_problems

SKYRL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + 2? Let's think."}],
        "env_class": "gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": str(i + 2)},
        "extra_info": {"split": "train", "index": i},
    }
    for i in range(4)
]


def _messages(value):
    return (
        [{k: v for k, v in m.items() if v is not None} for m in value] if isinstance(value, list) else value
    )


def test_skyrl_parquet_loads_unchanged(tmp_path):
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(SKYRL_ROWS).to_parquet(str(path))
    reference = pq.read_table(path).to_pylist()
    problems = load_problems(path)
    assert [p.prompt for p in problems] == [_messages(r["prompt"]) for r in reference]
    assert [p.answer for p in problems] == [r["reward_spec"]["ground_truth"] for r in reference]
    assert [p.meta["ground_truth"] for p in problems] == [r["reward_spec"]["ground_truth"] for r in reference]
    assert [p.meta["env_class"] for p in problems] == [r["env_class"] for r in reference]
    assert [p.meta["data_source"] for p in problems] == [r["data_source"] for r in reference]
    assert [p.meta["extra_info"] for p in problems] == [r["extra_info"] for r in reference]
    assert [p.id for p in problems] == [f"train-{i}" for i in range(1, 5)]


def test_save_to_disk_directory(tmp_path):
    datasets.Dataset.from_list(SKYRL_ROWS).save_to_disk(str(tmp_path / "ds"))
    reference = datasets.load_from_disk(str(tmp_path / "ds")).to_list()
    problems = load_problems(tmp_path / "ds")
    assert [p.answer for p in problems] == [r["reward_spec"]["ground_truth"] for r in reference]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SKYRL_ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match="holds the splits train"):
        load_problems(tmp_path / "dd")


def test_gsm8k_question_answer_parquet(tmp_path):
    rows = [
        {
            "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
            "answer": "In May she sold 48/2 = <<48/2=24>>24.\nAll: 48+24 = <<48+24=72>>72\n#### 72",
        },
        {"question": "What is 1,000 + 1?", "answer": "1000 + 1 = 1001\n#### 1,001"},
    ]
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    reference = pq.read_table(path).to_pylist()
    problems = load_problems(path)
    assert [p.prompt for p in problems] == [r["question"] for r in reference]
    assert [p.answer for p in problems] == [r["answer"].rsplit("####", 1)[1].strip() for r in reference]
    assert [p.answer for p in problems] == ["72", "1,001"]
    assert all(p.meta["gsm8k_format"] and p.meta["env_class"] is None for p in problems)
    assert problems[0].meta["data_source"] == "gsm8k"


def test_flat_jsonl_and_json_array(tmp_path):
    rows = [{"prompt": "What is 2+2?", "answer": 4}, {"id": "q2", "prompt": "Hi", "answer": 5}]
    jsonl, array = tmp_path / "flat.jsonl", tmp_path / "flat.json"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    array.write_text(json.dumps(rows))
    reference = pa_json.read_json(jsonl).to_pylist()
    for path in (jsonl, array):
        problems = load_problems(path)
        assert [p.prompt for p in problems] == [r["prompt"] for r in reference]
        assert [p.answer for p in problems] == [str(r["answer"]) for r in reference]
        assert [p.id for p in problems] == ["flat-1", "q2"]


def test_custom_keys(tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text(json.dumps({"problem": "2*3?", "solution": "6", "answer": "ignored"}) + "\n")
    (p,) = load_problems(path, prompt_key="problem", answer_key="solution")
    assert (p.prompt, p.answer) == ("2*3?", "6")
    with pytest.raises(DatasetError, match=r"custom.jsonl: no column 'question'.*data.prompt_key"):
        load_problems(path, prompt_key="question")


def test_mixed_prompt_types_in_jsonl(tmp_path):
    """Arrow needs one type per column; a JSONL mixing text and chat prompts still loads."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "answer": 1})
        + "\n"
        + json.dumps({"prompt": [{"role": "user", "content": "b"}], "answer": "x"})
        + "\n"
    )
    assert [p.prompt for p in load_jsonl(path)] == ["a", [{"role": "user", "content": "b"}]]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "a"}], r"no column 'answer'"),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}],
            r"row 2: column 'prompt' must be",
        ),
        ([{"prompt": "a", "answer": None}], r"row 1: column 'answer' holds no ground truth"),
        ([{"prompt": "a", "reward_spec": {"method": "rule"}}], r"row 1: column 'reward_spec.ground_truth'"),
    ],
)
def test_errors_name_file_row_and_column(tmp_path, rows, message):
    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(DatasetError, match=f"bad.parquet: {message}"):
        load_problems(path)


def test_unreadable_and_missing_files(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(DatasetError, match="junk.parquet: not Parquet"):
        load_problems(tmp_path / "junk.parquet")
    with pytest.raises(DatasetError, match="does not exist"):
        load_problems(tmp_path / "nope.parquet")
    (tmp_path / "rows.csv").write_text("prompt,answer\na,1\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        load_problems(tmp_path / "rows.csv")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": 1}\n{oops\n')
    with pytest.raises(DatasetError, match="bad.jsonl: line 2: not valid JSON"):
        load_problems(tmp_path / "bad.jsonl")
