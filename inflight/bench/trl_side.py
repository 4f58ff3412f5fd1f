"""The benchmark's handle on TRL: its interpreter (own venv), the settings and data its run gets, and
the worker process that runs it.

TRL is not a dependency of the package: it lives in `.venv-trl` (`scripts/trl_venv.sh`), and its side
of `inflight bench peers` is `trl_worker.py` run by that venv's python, one process per run. This
module turns an inflight run's resolved config and task into that run's settings (`trl_settings`:
the same start weights, prompts, reward, group size, optimizer, clip, completion length, temperature,
LoRA adapters, held-out problems and evaluation interval), writes the problems with the token ids
inflight's engine gets (the worker refuses to run if TRL's tokenization differs: chat prompts go
through the chat template on both sides), runs it and reads back its records.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import inflight

DEFAULT_VENV = Path(inflight.__file__).resolve().parents[1] / ".venv-trl"
ENV_VAR = "INFLIGHT_TRL_PYTHON"
WORKER_SCRIPT = Path(__file__).with_name("trl_worker.py")

TASK_REWARDS = {"addition": "exact", "count_up": "prefix_credit"}
"""The worker's reward (`trl_worker.REWARDS`) equal to each built-in single-turn task's own."""

NOT_ALIGNED = (
    "zero-variance groups: inflight leaves them out of the loss (trainer.algorithm.zero_variance_filter, "
    "its default; `trainer.algorithm.zero_variance_filter=false` aligns it), TRL trains on them (zero "
    "advantage, but their tokens count in the token mean)",
    "data order: both draw the same training problems without replacement, each shuffled by its own "
    "sampler from the round's seed",
    "micro-batches: TRL runs the step's prompts x group as one right-padded forward/backward, prompt "
    "repeated in every row; inflight runs each group as one packed row, its prompt once "
    "(trainer.shared_prefix_forward, the demo's setting: the same gradients for fewer tokens), cutting "
    "micro-batches of whole groups where padded tokens plus trainer.micro_batch_pass_tokens per pass are "
    "fewest",
    "staleness: the fully-async trainer trains on rollouts up to max_staleness_steps old, corrected by "
    "truncated importance sampling (trainer.algorithm.off_policy_correction); TRL and the synchronous "
    "trainer are on-policy",
    "threads: TRL runs one process with `--trl-threads` torch threads (2: its natural setting); inflight "
    "a trainer and an engine process with job.threads and job.engine_threads (1 each; "
    "job.lend_threads=true lets the side that computes alone borrow the other's)",
    "advantage epsilon: GRPO's (r - mean) / (std + eps) with eps 1e-6 in inflight, 1e-4 in TRL",
    "LoRA start (LoRA workloads): both sides build the same peft LoraConfig, B at zero (the same start "
    "model), A drawn from each side's own random stream",
)
"""Every setting of the two sides that the bench does not make equal, and why."""


class TrlUnavailable(RuntimeError):
    """TRL's interpreter is missing or cannot import TRL; the message says how to set it up."""


def default_python() -> str:
    """`$INFLIGHT_TRL_PYTHON`, else the repository's `.venv-trl/bin/python`."""
    return os.environ.get(ENV_VAR) or str(DEFAULT_VENV / "bin" / "python")


def hello(python: str) -> dict[str, Any]:
    """The worker's `--hello` (versions); `TrlUnavailable` naming the fix when it cannot run."""
    fix = (f"TRL lives in its own virtual environment, outside the project's dependencies; create it with "
           f"scripts/trl_venv.sh (TRL_VENV=<dir> for another place), or point --trl-python / ${ENV_VAR} at "
           f"an interpreter that has torch, transformers, datasets and trl")
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise TrlUnavailable(f"TRL's python not found at {python}. {fix}")
    done = subprocess.run(
        [python, str(WORKER_SCRIPT), "--hello"], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise TrlUnavailable(f"TRL does not import with {python}:\n{done.stderr[-2000:]}\n{fix}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def trainable_problem(model: str | Path) -> str | None:
    """Why TRL's Trainer would refuse to train the model directory, or None: transformers' Trainer
    trains no quantized model, and a directory saved from a GGUF load keeps its quantization_config."""
    config = Path(model) / "config.json"
    method = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method") \
        if config.is_file() else None
    if method is None:
        return None
    return (
        f"{config} has a quantization_config (quant_method {method}): TRL's Trainer (transformers') refuses "
        "to train a quantized model; give a plain floating-point model directory (`inflight models get "
        "smollm2-135m-instruct` writes one), or leave TRL out (--sides sync,fully_async)"
    )


def write_problems(path: Path, task: Any, problems: Any) -> Path:
    """`problems` as JSON lines: the prompt's text, the token ids inflight's engine gets for it
    (`task.encode_prompt`) and the answer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "prompt_ids": task.encode_prompt(p.prompt),
                                "answer": p.answer}) + "\n")
    return path


def trl_reward(task: Any) -> str:
    """The worker's name of the reward that scores `task`: a built-in task's copy
    (`TASK_REWARDS`), or for data files the one reward every row names, when it is among the
    `inflight.rewards` files the worker loads (`trl_worker.SHARED_REWARDS`). A ValueError otherwise."""
    from inflight.bench.trl_worker import SHARED_REWARDS
    from inflight.tasks.data_task import DataTask, reward_name

    if task.name in TASK_REWARDS:
        return TASK_REWARDS[task.name]
    if not isinstance(task, DataTask):
        raise ValueError(f"bench peers runs the built-in tasks {', '.join(TASK_REWARDS)} or data files, not "
                         f"{task.name!r}: TRL's side scores with its own copy of each task's reward")
    names = sorted({reward_name(p, task.env_class) for p in [*task.train_problems(), *task.eval_problems()]})
    if len(names) != 1 or names[0] not in SHARED_REWARDS:
        raise ValueError(
            f"bench peers on data files needs every row scored by one of {', '.join(SHARED_REWARDS)} "
            f"(inflight.rewards' files that TRL's worker loads); the rows name {', '.join(names)} "
            "(their env_class column, else environment.env_class)"
        )
    return names[0]


def trl_settings(cfg: Any, task: Any, model: str, out: Path, seconds: float, threads: int,
                 max_steps: int | None = None) -> dict[str, Any]:
    """The settings file of TRL's run equal to the inflight run of config `cfg` on `task` from
    `model`; writes its training and held-out problems into `out`. A ValueError names what TRL's
    side has no equal for."""
    from inflight.train.lora import lora_enabled, lora_kwargs

    reward = trl_reward(task)
    trainer, generator = cfg.trainer, cfg.generator
    opt, alg = trainer.policy.optimizer_config, trainer.algorithm
    if opt.scheduler not in ("constant", "constant_with_warmup") or opt.num_warmup_steps:
        raise ValueError(f"bench peers aligns a constant learning rate only, not {opt.scheduler} with "
                         f"{opt.num_warmup_steps} warm-up steps")
    if trainer.policy_mini_batch_size != trainer.train_batch_size or trainer.update_epochs_per_batch != 1:
        raise ValueError(
            "bench peers aligns one optimizer step per batch: set trainer.policy_mini_batch_size = "
            "trainer.train_batch_size and trainer.update_epochs_per_batch=1"
        )
    _require_aligned(cfg)
    sampling = generator.sampling_params
    return {
        "model_dir": str(model),
        "output_dir": str(out / "trl"),
        "reward": reward,
        "lora": lora_kwargs(cfg) if lora_enabled(cfg) else None,
        "train_file": str(write_problems(out / "train.jsonl", task, task.train_problems())),
        "eval_file": str(write_problems(out / "eval.jsonl", task, task.eval_problems())),
        "threshold": trainer.correct_threshold,
        "seed": trainer.seed,
        "threads": threads,
        "prompts_per_step": trainer.train_batch_size,
        "group_size": generator.n_samples_per_prompt,
        "lr": opt.lr,
        "betas": list(opt.adam_betas),
        "adam_eps": _adamw_eps(),
        "weight_decay": opt.weight_decay,
        "max_grad_norm": opt.max_grad_norm,
        "clip_low": alg.eps_clip_low,
        "clip_high": alg.eps_clip_high,
        "max_tokens": min(sampling.max_generate_length, task.max_new_tokens),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(sampling.top_k, 0),
        # keys the schema may lack (older configs): their neutral values
        "min_p": getattr(sampling, "min_p", 0.0) or None,
        "repetition_penalty": getattr(sampling, "repetition_penalty", 1.0),
        "eval_max_tokens": min(generator.eval_sampling_params.max_generate_length, task.max_new_tokens),
        "eval_batch_size": trainer.eval_batch_size,
        "eval_interval": trainer.eval_interval,
        "seconds": seconds,
        "max_steps": max_steps or 10**7,
    }


ALIGNABLE = {
    "trainer.algorithm.advantage_estimator": "grpo",
    "trainer.algorithm.grpo_norm_by_std": True,  # TRL's scale_rewards=group
    "trainer.algorithm.loss_reduction": "token_mean",  # TRL's loss_type=dapo
    "trainer.algorithm.use_kl_loss": False,  # TRL's beta=0
    "trainer.algorithm.policy_loss_type": "regular",
    "trainer.algorithm.use_entropy_loss": False,
    "trainer.algorithm.use_kl_in_reward": False,
    "trainer.algorithm.advantage_batch_normalize": False,
    "trainer.bf16": False,  # TRL's side trains in float32
    "generator.inference_engine.model_dtype": "float32",  # and generates in it
    "generator.eval_sampling_params.temperature": 0.0,  # TRL's evaluation is greedy, one answer each
    "generator.eval_n_samples_per_prompt": 1,
}
"""The settings TRL's side has an equal for only at these values (a key the schema lacks is skipped)."""


def _require_aligned(cfg: Any) -> None:
    wrong = []
    for key, want in ALIGNABLE.items():
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part, _MISSING)
        if value is not _MISSING and value != want:
            wrong.append(f"{key}={value!r} (TRL's side has an equal only for {want!r})")
    if wrong:
        raise ValueError("bench peers cannot align " + "; ".join(wrong))


_MISSING = object()


def _adamw_eps() -> float:
    """AdamW's epsilon in inflight's worker: torch's default (`build_optimizer` does not set it)."""
    import inspect

    import torch

    return inspect.signature(torch.optim.AdamW).parameters["eps"].default


def run_trl(python: str, settings: dict[str, Any], log: Path) -> dict[str, Any]:
    """Run TRL's side with `settings` (its output in `settings["output_dir"]`, its stderr in `log`);
    returns its summary with `records` (the per-step and evaluation records) and `wall_s`, `cpu_s`
    (the whole process: imports, set-up, evaluations, training)."""
    out = Path(settings["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "settings.json"
    path.write_text(json.dumps(settings, indent=2))
    before = os.times()
    with log.open("w") as err:
        started = time.perf_counter()
        done = subprocess.run([python, str(WORKER_SCRIPT), str(path)], stdout=err, stderr=subprocess.STDOUT)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"TRL's run failed (exit {done.returncode}); its log {log} ends:\n{tail}")
    after = os.times()
    summary = json.loads((out / "summary.json").read_text())
    summary["records"] = [
        json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line
    ]
    summary.update(wall_s=wall, cpu_s=after.children_user + after.children_system
                   - before.children_user - before.children_system)
    return summary
