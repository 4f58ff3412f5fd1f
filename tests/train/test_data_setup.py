"""`inflight train` on your own data: the data task is chosen by data.train_data, every key not given
is SkyRL's default (nothing of the demo job), bad data fails before training, a zero-token step
fails loudly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets
import pytest

from inflight.config import ConfigError
from inflight.tasks import DataTask
from inflight.testing import LOCAL_CPU
from inflight.train.data_setup import NothingGeneratedError, check_generated
from inflight.train.main import main, make_task, resolve_config


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen2 with a BPE tokenizer and a chat template, 128 positions."""
    from inflight.testing import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("chat-model"), "qwen2", seed=0, max_position_embeddings=128
    )


def _skyrl_parquet(path, questions):
    rows = [
        {
            "data_source": "arith",
            "prompt": [{"role": "user", "content": q}],
            "env_class": "gsm8k",
            "reward_spec": {"method": "rule", "ground_truth": "3"},
            "extra_info": {"index": i},
        }
        for i, q in enumerate(questions)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_a_run_without_a_config_file_takes_skyrls_defaults_and_nothing_of_the_demo(tmp_path):
    from inflight.config import Config

    data = f"data.train_data=[{tmp_path / 'd.parquet'}]"
    cfg, job = resolve_config(None, [data])
    skyrl = Config()
    assert cfg.generator == skyrl.generator and cfg.trainer == skyrl.trainer  # SkyRL's defaults throughout
    assert job.max_train_seconds is None and job.task is None  # no demo time budget, no built-in task
    cfg, _ = resolve_config(None, [data, "generator.sampling_params.max_generate_length=300"])
    assert cfg.generator.sampling_params.max_generate_length == 300  # the user's own setting wins
    demo = tmp_path.parent / "demo.yaml"
    demo.write_text("base: demo\n")
    cfg, job = resolve_config(str(demo), [])
    assert (cfg.generator.inference_engine.max_model_len, job.task, job.max_train_seconds) == (
        64,
        "addition",
        1800,
    )


def test_data_task_is_built_from_data_keys(tmp_path, chat_model):
    path = _skyrl_parquet(tmp_path / "train.parquet", [f"What is {i} + 1?" for i in range(20)])
    cfg, job = resolve_config(None, [f"data.train_data=[{path}]", "data.val_data=[]",
                                     f"trainer.policy.model.path={chat_model}"])
    task = make_task(cfg, job)
    assert isinstance(task, DataTask) and task.max_new_tokens == 1024
    assert (task.report.train_rows, task.report.val_rows) == (18, 2)
    assert task.report.max_prompt_length == 127  # the model's 128 positions leave 127 for a prompt


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["environment.env_class=math", "job.task=addition"], ["environment.env_class"]),
        (["data.train_data=[a.parquet]", "job.task=count_up"], ["data.train_data"]),
        ([], ["trainer.policy.model.path"]),
        (
            [
                "data.train_data=[a.parquet]",
                "trainer.policy.model.path=m",
                "job.task=jsonl",
                "job.train_data=b.jsonl",
            ],
            ["job.train_data"],
        ),
    ],
)
def test_contradictions_are_config_errors(overrides, keys):
    cfg, job = resolve_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        make_task(cfg, job)
    assert err.value.keys == keys


def test_zero_generated_tokens_fail_loudly(tmp_path):
    demo = tmp_path / "demo.yaml"
    demo.write_text("base: demo\n")
    cfg, _ = resolve_config(str(demo), [])
    empty = SimpleNamespace(prompt_ids=[1] * 64, num_generated=0, num_sampled=0, finish_reason="length")
    groups = [SimpleNamespace(trajectories=[empty, empty])]
    with pytest.raises(
        NothingGeneratedError,
        match=r"hold no generated token \(finish reasons: length x2\).*"
        r"up to 64 tokens.*max_generate_length=8.*max_model_len=64",
    ):
        check_generated(groups, cfg)
    check_generated(
        [
            SimpleNamespace(
                trajectories=[SimpleNamespace(**{**vars(empty), "num_generated": 1, "num_sampled": 1})]
            )
        ],
        cfg,
    )


def _train_args(chat_model, tmp_path, *extra):
    return [
        *LOCAL_CPU,
        f"trainer.policy.model.path={chat_model}",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.fully_async.num_parallel_generation_workers=2",
        "generator.n_samples_per_prompt=2",
        "generator.sampling_params.max_generate_length=6",
        "generator.inference_engine.weight_sync_backend=inprocess",
        "trainer.max_prompt_length=40",
        f"job.output_dir={tmp_path / 'out'}",
        "job.max_steps=1",
        "job.num_eval=2",
        "job.tensorboard=false",
        "job.plot=false",
        "job.progress=false",
        *extra,
    ]


def test_too_long_prompts_refused_before_training(tmp_path, chat_model, capsys):
    long = "Please add these numbers carefully: " + " + ".join(["1"] * 40)
    path = _skyrl_parquet(tmp_path / "train.parquet", ["1 + 2?", long, "2 + 1?"])
    code = main(
        _train_args(chat_model, tmp_path, f"data.train_data=[{path}]", "data.drop_long_prompts=false")
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "train.parquet:2: the prompt has" in err and "trainer.max_prompt_length=40" in err
    code = main(_train_args(chat_model, tmp_path, f"data.train_data=[{path}]", "trainer.max_prompt_length=5"))
    assert code == 2 and "every train prompt is longer than" in capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing trained


def test_run_on_user_data_drops_long_prompts_and_reports_the_split(tmp_path, chat_model, capsys):
    long = "Please add these numbers carefully: " + " + ".join(["1"] * 40)
    questions = [f"What is {i} + 1?" for i in range(8)] + [long, long]
    path = _skyrl_parquet(tmp_path / "train.parquet", questions)
    assert main(_train_args(chat_model, tmp_path, f"data.train_data=[{path}]")) == 0
    out = capsys.readouterr().out
    assert "data: 7 training problems, 1 held-out split off the training data" in out
    assert "dropped 2 prompts longer than 40 tokens" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["data"]["dropped_long_prompts"] == {"train": 2}
    assert (summary["data"]["train_rows"], summary["data"]["val_rows"]) == (7, 1)
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("generated_tokens", 0) > 0 for s in steps)
    consumed = [json.loads(line) for line in (tmp_path / "out" / "consumed.jsonl").read_text().splitlines()]
    trained = {i for r in consumed for i in r.get("trained", [])}
    task = make_task(
        *resolve_config(
            None,
            [
                f"data.train_data=[{path}]",
                "data.val_data=[]",
                f"trainer.policy.model.path={chat_model}",
                "trainer.max_prompt_length=40",
                "job.num_eval=2",
            ],
        )
    )
    assert trained and not trained & {p.id for p in task.eval_problems()}  # held-out rows never trained on
