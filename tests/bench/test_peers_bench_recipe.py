"""`inflight bench peers --workload smollm2`: a real chat model's recipe (examples/smollm2) on both
sides. TRL's worker scores with `inflight.rewards`' own file, builds peft's LoRA from inflight's own
keyword arguments and checks its chat-template token ids against ours; the bench path runs on a tiny
local Llama with a ChatML template and a tiny data file of the recipe's kind (TRL's side when
`.venv-trl` exists: scripts/trl_venv.sh)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from inflight.bench import trl_worker
from inflight.bench.peers_bench import REPOSITORY, WORKLOADS, main, recipe_base
from inflight.bench.rl_bench import bench_config, make_bench_task, run_overrides
from inflight.bench.trl_side import trl_settings
from inflight.rewards import get_reward
from inflight.rewards import gsm8k as gsm8k_module
from inflight.testing.tiny_model import make_tiny_model
from inflight.train.lora import apply_lora, lora_kwargs

RECIPE = WORKLOADS["smollm2"].recipe
RESPONSES = [
    "25",
    "17 + 8 = 25",
    "17 + 8 = 25. This adds 17 and 8.",
    "The sum is $1,025.",
    "25.",
    " 25\n",
    "-25",
    "25.0",
    "2 5",
    "twenty-five",
    "",
    "The answer: 24, no, 25",
    "1,000",
    "25/1",
    "#### 25",
    "25 apples",
]


@pytest.mark.parametrize("name", sorted(trl_worker.SHARED_REWARDS))
def test_the_worker_scores_with_inflight_rewards_own_file_without_inflight(name):
    """Loaded by path in an interpreter where `inflight` cannot be imported (TRL's venv lacks it),
    the worker's reward is the registry's: the same scores, from the same file."""
    code = ("import json, runpy, sys; sys.modules['inflight'] = None; "
            f"g = runpy.run_path({trl_worker.__file__!r}); f = g['reward_for']({name!r}); "
            f"print(json.dumps([f(r, a) for r in {RESPONSES!r} for a in ('25', '1025', '1000')]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    want = [get_reward(name)(r, a) for r in RESPONSES for a in ("25", "1025", "1000")]
    assert json.loads(done.stdout) == want and set(want) == {0.0, 1.0}
    here = trl_worker.reward_for(name)
    assert Path(here.__code__.co_filename).resolve() == Path(gsm8k_module.__file__).resolve()


def test_lora_kwargs_are_the_adapters_apply_lora_builds(tmp_path):
    """TRL's side builds peft.LoraConfig(**lora_kwargs(cfg)) (in its venv's peft, the same version):
    the same adapted modules, shapes, scaling and dropout as inflight's trainer gets from apply_lora."""
    model_dir = make_tiny_model(tmp_path / "m", arch="llama")
    cfg, _ = bench_config([f"trainer.policy.model.path={model_dir}"], str(REPOSITORY / RECIPE))
    ours = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg)
    kwargs = json.loads(json.dumps(lora_kwargs(cfg)))  # as the settings file carries them
    theirs = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                 peft.LoraConfig(**kwargs))

    def adapters(model):
        return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}

    assert adapters(ours) == adapters(theirs) and len(adapters(ours)) == 2 * 7 * 2  # 7 linears x 2 layers
    mine, other = ours.peft_config["default"], theirs.peft_config["default"]
    lora = yaml.safe_load((REPOSITORY / RECIPE).read_text())["trainer"]["policy"]["model"]["lora"]
    assert (other.r, other.lora_alpha, other.lora_dropout) == (
        lora["rank"],
        lora["alpha"],
        lora.get("dropout", 0.0),
    )
    for key in (
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "init_lora_weights",
        "use_rslora",
        "bias",
    ):
        assert getattr(mine, key) == getattr(other, key), key


def _recipe_data(out: Path, num_train: int = 64, num_test: int = 16) -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location(
        "smollm2_make_data", REPOSITORY / "examples/smollm2/make_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write(out, num_train, num_test)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """A tiny Llama with a ChatML template and a small data set of the recipe's kind; the overrides
    that point the recipe at them."""
    root = tmp_path_factory.mktemp("recipe")
    model = make_tiny_model(root / "model", arch="llama")
    data = _recipe_data(root / "data")
    return model, [f"data.train_data=['{data['train']}']", f"data.val_data=['{data['test']}']",
                   "job.tensorboard=false"]


def recipe_config(model: Path, data: list[str], *extra: str):
    """(cfg, job) of a bench run of the recipe on `model`, as `bench peers --workload smollm2` makes it."""
    workload = WORKLOADS["smollm2"]
    common = run_overrides(None, 5, 2, [*workload.overrides, *data, *extra])
    return bench_config([*common, f"trainer.policy.model.path={model}"], recipe_base(workload, model))


def test_trl_settings_of_the_recipe(recipe, tmp_path):
    model, data = recipe
    cfg, job = recipe_config(model, data)
    assert cfg.trainer.bf16 is False and cfg.trainer.max_training_steps is None  # float32; the bench's budget
    task = make_bench_task(cfg, job)
    settings = trl_settings(cfg, task, model, tmp_path, 5.0, 2)
    assert settings["reward"] == "gsm8k_flexible" and settings["lora"] == lora_kwargs(cfg)
    # what the recipe file says, read here with yaml (the bench resolves it through inflight's config)
    file = yaml.safe_load((REPOSITORY / RECIPE).read_text())
    trainer, generator = file["trainer"], file["generator"]
    lora, algorithm = trainer["policy"]["model"]["lora"], trainer["algorithm"]
    assert (settings["lora"]["r"], settings["lora"]["lora_alpha"]) == (lora["rank"], lora["alpha"])
    assert settings["lora"]["target_modules"] == "all-linear" == lora["target_modules"]
    assert (settings["prompts_per_step"], settings["group_size"]) == (trainer["train_batch_size"],
                                                                      generator["n_samples_per_prompt"])
    assert settings["lr"] == trainer["policy"]["optimizer_config"]["lr"]
    assert (settings["max_tokens"], settings["temperature"]) == (
        generator["sampling_params"]["max_generate_length"],
        generator["sampling_params"]["temperature"],
    )
    assert settings["eval_max_tokens"] == generator["eval_sampling_params"]["max_generate_length"]
    assert (settings["clip_low"], settings["clip_high"]) == (
        algorithm["eps_clip_low"],
        algorithm["eps_clip_high"],
    )
    assert settings["eval_interval"] == 2  # the bench's
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and rows[0]["prompt"][0]["role"] == "user"
    # the engine's prompt ids are the tokenizer's chat template with the generation prompt, as TRL's are
    tokenizer = AutoTokenizer.from_pretrained(model)
    for row in rows[:8]:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        assert row["prompt_ids"] == list(ids)
        assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_the_runs_are_not_capped_by_their_configs_step_count():
    """The demo job's max_training_steps (2000) and the recipe's (60) would end a timed run early:
    the bench lifts them (job.max_steps=null, the alias, was read as not given)."""
    cfg, _ = bench_config(run_overrides("addition", 5, 2, []))
    assert cfg.trainer.max_training_steps is None
    cfg, _ = bench_config(run_overrides(None, 5, 2, []), str(REPOSITORY / RECIPE))
    assert cfg.trainer.max_training_steps is None


@pytest.mark.parametrize("override, key", [
    ("trainer.bf16=true", "trainer.bf16"),
    ("trainer.bf16=null", "trainer.bf16"),  # the recipe's own: bfloat16 on AMX / AVX-512-BF16 CPUs
    ("generator.eval_sampling_params.temperature=0.7", "generator.eval_sampling_params.temperature"),
    ("generator.eval_n_samples_per_prompt=4", "generator.eval_n_samples_per_prompt"),
    ("generator.inference_engine.model_dtype=bfloat16", "generator.inference_engine.model_dtype"),
])
def test_settings_trl_cannot_match_are_refused(recipe, tmp_path, override, key):
    model, data = recipe
    cfg, job = recipe_config(model, data, override)
    with pytest.raises(ValueError, match=key):
        trl_settings(cfg, make_bench_task(cfg, job), model, tmp_path, 5.0, 2)


def test_rows_scored_by_a_reward_the_worker_lacks_are_refused(recipe, tmp_path):
    model, data = recipe
    cfg, job = recipe_config(model, data, "environment.env_class=exact")
    task = make_bench_task(cfg, job)
    for p in [*task.train_problems(), *task.eval_problems()]:
        p.meta.pop("env_class")  # the rows name none: environment.env_class scores them
    with pytest.raises(ValueError, match="the rows name exact"):
        trl_settings(cfg, task, model, tmp_path, 5.0, 2)


def test_the_recipe_needs_a_model_and_its_data_before_any_run(recipe, tmp_path):
    model, data = recipe
    with pytest.raises(SystemExit, match="--model DIR"):
        main(["--workload", "smollm2", "--sides", "sync", "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="data.train_data.*does not exist") as err:
        main(
            [
                "--workload",
                "smollm2",
                "--model",
                str(model),
                "--sides",
                "sync",
                "--output-dir",
                str(tmp_path),
                f"data.train_data=['{tmp_path / 'missing.parquet'}']",
            ]
        )
    assert RECIPE in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_quantized_model_dir_is_refused_before_any_run(recipe, tmp_path):
    """A directory saved from a GGUF load keeps a quantization_config, which transformers' Trainer
    (TRL's side) refuses to train minutes in: the bench names the file and the fix at once."""
    import shutil

    from inflight.bench.trl_side import default_python, trainable_problem

    model, data = recipe
    assert trainable_problem(model) is None
    quantized = shutil.copytree(model, tmp_path / "quantized")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False}
    (quantized / "config.json").write_text(json.dumps(config))
    assert "config.json has a quantization_config (quant_method gguf)" in trainable_problem(quantized)
    if not Path(default_python()).exists():
        pytest.skip("the bench checks it once TRL's venv answers (scripts/trl_venv.sh creates it)")
    out = tmp_path / "bench"
    with pytest.raises(SystemExit, match="inflight models get"):
        main(["--workload", "smollm2", "--model", str(quantized), "--output-dir", str(out), *data])
    assert not out.exists()


# three sides' runs and evaluations; TRL's alone took 5 minutes on a loaded 2-CPU box
@pytest.mark.timeout(1800)
def test_bench_peers_smollm2_smoke(recipe, tmp_path):
    """The whole bench on the recipe for 2 steps a run (a budget in work; the seconds only a cap),
    answers cut to 16 tokens: both inflight trainers, and TRL's GRPOTrainer with the same LoRA when
    its venv exists (one thread: no OpenMP spinning on a loaded machine), whose worker refuses to
    run unless its chat-template token ids equal ours."""
    from inflight.bench.peers_report import table
    from inflight.bench.trl_side import default_python

    model, data = recipe
    has_trl = Path(default_python()).exists()
    sides = "trl,sync,fully_async" if has_trl else "sync,fully_async"
    out = tmp_path / "bench"
    argv = [
        "--workload",
        "smollm2",
        "--model",
        str(model),
        "--steps",
        "2",
        "--seconds",
        "600",
        "--repeats",
        "1",
        "--eval-interval",
        "2",
        "--sides",
        sides,
        "--trl-threads",
        "1",
        "--output-dir",
        str(out),
        *data,
        "generator.sampling_params.max_generate_length=16",
        "generator.eval_sampling_params.max_generate_length=16",
    ]
    assert main(argv) == 0
    result = json.loads((out / "bench_peers.json").read_text())
    assert set(result["results"]) == set(sides.split(",")) and result["eval_problems"] == 16
    for rows in result["results"].values():
        (row,) = rows
        curve = row["curve"]
        assert row["steps"] == 2 and row["eval_problems"] == 16 and row["samples_per_s"] > 0
        assert curve[0] == [0.0, row["before"]] and curve[-1][1] == row["after"] and len(curve) >= 2
    text = (out / "bench_peers.md").read_text()
    assert text == table(result) and str(model) in text and "LoRA start" in text and result["cpu"] in text
    if not has_trl:
        return
    (trl,) = result["results"]["trl"]
    settings = trl["settings"]
    assert settings["reward"] == "gsm8k_flexible" and settings["lora"]["r"] == 32 and trl["samples"] == 2 * 64
    assert (settings["max_tokens"], settings["eval_max_tokens"], trl["threads"]) == (16, 16, 1)
    # the same start model, prompts and greedy evaluation: transformers' generate and our engine agree
    (sync,) = result["results"]["sync"]
    assert trl["before"] == pytest.approx(sync["before"], abs=1 / 16 + 1e-9)
    assert result["summary"]["sync"]["vs_trl"]["samples_per_s"] > 0
