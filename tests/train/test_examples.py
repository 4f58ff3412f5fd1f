"""Every example config loads, and each says what its name promises (plan, trainer, worker)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from example_scripts import load_example

from inflight.train.defaults import DEFAULT_JOB_YAML, default_job
from inflight.train.main import resolve_config
from inflight.weight_sync import plan_weight_sync

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_default_example_is_the_built_in_default():
    assert yaml.safe_load((EXAMPLES / "default.yaml").read_text()) == default_job()
    assert (EXAMPLES / "default.yaml").read_text() == DEFAULT_JOB_YAML


@pytest.mark.parametrize(
    "name, fully_async, fate, strategy, worker",
    [
        ("default", True, "keep", "fsdp", "auto"),
        ("synchronous", False, "none", "fsdp", "auto"),
        ("kv_keep", True, "keep", "fsdp", "auto"),
        ("kv_offload", True, "offload", "fsdp", "auto"),
        ("kv_recompute", True, "recompute", "fsdp", "auto"),
        ("fsdp", True, "keep", "fsdp", "fsdp"),
        ("megatron", True, "keep", "megatron", "auto"),
        ("hf_gpu", True, "keep", "fsdp", "auto"),
    ],
)
def test_example(name, fully_async, fate, strategy, worker):
    cfg, job = resolve_config(str(EXAMPLES / f"{name}.yaml"), [])
    assert cfg.trainer.fully_async.enabled is fully_async
    assert plan_weight_sync(cfg).kv_fate == fate
    assert cfg.trainer.strategy == strategy and job.worker == worker


def test_no_config_means_skyrls_defaults_and_the_old_job_spellings_set_their_keys():
    cfg, job = resolve_config(
        None,
        [
            "job.max_steps=5", "job.resume=false", "trainer.fully_async.enabled=true",
            "trainer.placement.colocate_all=false", "trainer.train_batch_size=256",
        ],
    )
    assert cfg.trainer.max_training_steps == 5 and cfg.trainer.resume_mode is None
    assert cfg.trainer.fully_async.enabled and job.task is None
    # SkyRL's
    assert cfg.trainer.policy.optimizer_config.lr == 1e-6 and cfg.generator.n_samples_per_prompt == 5


def test_job_config_errors_are_listed():
    from inflight.config import ConfigError

    with pytest.raises(ConfigError) as err:
        resolve_config(None, ["job.max_step=5", "job.threads=zero"])
    assert err.value.keys == ["job.max_step", "job.threads"]
    assert "did you mean 'job.max_steps'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve_config(None, ["job.tis=tokens", "job.task=jsonl"])
    assert err.value.keys == ["job.tis", "job.train_data"]


@pytest.mark.parametrize("task", ["addition", "chain_addition", "count_up"])
def test_each_builtin_task_is_built_by_name(task):
    from inflight.tasks.registry import BUILTIN_TASKS
    from inflight.train.main import make_task

    cfg, job = resolve_config(str(EXAMPLES / "count_up.yaml") if task == "count_up" else None,
                              [f"job.task={task}", "job.num_train=20", "job.num_eval=5"])  # fmt: skip
    built = make_task(cfg, job)
    assert type(built) is BUILTIN_TASKS[task]
    assert len(built.eval_problems()) == 5


def test_gsm8k_example_writes_skyrl_rows_and_its_config_trains_on_them(tmp_path, tiny_model_factory):
    """examples/gsm8k: make_data.py writes SkyRL-format parquet (read back with pyarrow), and the config
    trains on it with the gsm8k reward once a model path is given."""

    import pyarrow.parquet as pq

    from inflight.tasks import DataTask
    from inflight.train.main import make_task

    make_data = load_example("gsm8k")
    paths = make_data.write(tmp_path, num_train=30, num_test=6, seed=0)
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    assert len(train) == 30 and len(test) == 6
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    for row in train:
        assert row["env_class"] == "gsm8k" and row["reward_spec"]["method"] == "rule"
        assert row["extra_info"]["answer"].endswith(f"#### {row['reward_spec']['ground_truth']}")
    cfg, job = resolve_config(str(EXAMPLES / "gsm8k" / "config.yaml"),
                              [f"trainer.policy.model.path={tiny_model_factory()}",
                               f"data.train_data=[{paths['train']}]", f"data.val_data=[{paths['test']}]"])
    assert cfg.environment.env_class == "gsm8k" and plan_weight_sync(cfg).kv_fate == "keep"
    task = make_task(cfg, job)
    assert isinstance(task, DataTask) and len(task.train_problems()) == 30 and len(task.eval_problems()) == 6
    problem = task.train_problems()[0]
    assert task.reward(problem, f"so... #### {problem.answer}") == 1.0
    assert task.reward(problem, problem.meta["extra_info"]["answer"]) == 1.0  # the worked solution scores 1
    assert task.reward(problem, "#### -1") == 0.0


def _redundant(base: dict, over: dict, prefix: str = "") -> list[str]:
    """Keys of `over` that only repeat what `base` already says."""
    out = []
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            out += _redundant(base[key], value, f"{prefix}{key}.")
        elif key in base and base[key] == value:
            out.append(prefix + key)
    return out


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_examples_on_the_default_job_hold_only_what_differs(path):
    data = yaml.safe_load(path.read_text())
    if data.get("base") != "default":
        return  # the default job itself, and hf_gpu (a whole real-checkpoint config)
    assert _redundant(default_job(), {k: v for k, v in data.items() if k != "base"}) == []


def test_a_base_path_is_relative_to_the_config_and_merges_key_by_key(tmp_path):
    (tmp_path / "parent.yaml").write_text("base: default\ntrainer:\n  seed: 7\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrainer:\n  epochs: 3\n")
    cfg, _ = resolve_config(str(tmp_path / "child.yaml"), [])
    assert (cfg.trainer.seed, cfg.trainer.epochs) == (7, 3)
    assert cfg.trainer.policy.optimizer_config.lr == 1e-4  # from the default job, two bases up


def test_the_smollm2_recipe_writes_disjoint_sums_and_resolves(tmp_path):

    import datasets

    from inflight.rewards import get_reward

    make_data = load_example("smollm2")
    paths = make_data.write(tmp_path, num_train=300, num_test=50, seed=3)
    train, test = (datasets.Dataset.from_parquet(str(paths[s])) for s in ("train", "test"))
    pairs = {split: {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows} for split, rows in
             (("train", train), ("test", test))}
    assert len(train) == 300 and len(test) == 50 == len(pairs["test"]) and not pairs["train"] & pairs["test"]
    row = test[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"] == [{"role": "user", "content": f"What is {a} + {b}?"}]
    reward = get_reward(row["env_class"])
    truth = row["reward_spec"]["ground_truth"]
    # the rule the recipe teaches: the sum must be the last number written
    assert reward(f"{a} + {b} = {a + b}.", truth) == 1.0
    assert reward(f"{a} + {b} = {a + b}. This adds {a} and {b}.", truth) == 0.0
    cfg, job = resolve_config(str(EXAMPLES / "smollm2" / "config.yaml"),
                              [f"data.train_data=['{paths['train']}']", f"data.val_data=['{paths['test']}']"])
    assert cfg.trainer.fully_async.enabled and cfg.trainer.policy.model.lora.rank > 0
    assert cfg.trainer.shared_prefix_forward and cfg.environment.env_class == "gsm8k_flexible"
    assert plan_weight_sync(cfg).kv_fate == "keep"
