"""TRL's side of `inflight bench peers`, run as a script by the interpreter of TRL's own venv.

It imports nothing from `inflight` (that venv does not have it): the standard library at import,
and torch, transformers, datasets and TRL (peft for a LoRA run) once a run starts, so the reward
functions below can be imported (and checked against the tasks' own rewards) from any interpreter.
The rewards of data-file workloads are `inflight.rewards`' own files, loaded by path
(`SHARED_REWARDS`), not copies.

`python trl_worker.py --hello` prints the versions as one JSON line. `python trl_worker.py
SETTINGS.json` runs one GRPO run with TRL's `GRPOTrainer` (transformers generation, one process,
`threads` torch threads) as the settings file says (`inflight.bench.trl_side.trl_settings` writes
it) and writes, into its `output_dir`:

- `records.jsonl`: one line per training step (`step`, `time` since training began, `samples`,
  `reward`, `generated_tokens`) and one per evaluation (`step`, `time`, `eval/accuracy`,
  `eval/seconds`), step 0 at time 0 the evaluation before training;
- `summary.json`: `steps`, `train_seconds`, `samples`, `samples_per_s`, `before`, `after`, the CPU
  time of this process while training (`train_cpu_s`) and the versions.

The clock: it starts when TRL's training begins (its callback's `on_train_begin`, after the model,
optimizer and data loader are set up, as inflight's starts after its engines and policy are) and
runs through the periodic evaluations, which run every `eval_interval` optimizer steps inside the
training loop (inside the clock, as inflight's synchronous trainer's do), each recorded at the time
its step ended. Training stops at the first step end past `seconds`. The evaluations before and
after training are outside the clock (as inflight's are). An evaluation is greedy
(`model.generate`, `do_sample=False`) on every held-out prompt, `eval_max_tokens` new tokens at
most, `eval_batch_size` prompts per call, left-padded; a response is correct when its reward
reaches `threshold`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


# ---- rewards (the tasks' own, on text: `tests/bench/test_peers_bench.py` checks them against those) ----
def exact_reward(response: str, answer: str) -> float:
    """1 for the exact answer (surrounding whitespace ignored), else 0: the addition task's."""
    return 1.0 if response.strip() == answer else 0.0


def prefix_credit_reward(response: str, answer: str) -> float:
    """count_up's partial credit: the leading comma-separated items of the response equal to the
    answer's, over the longer of the two lists (1 only for the exact answer)."""
    want, got = answer.split(","), response.strip().split(",")
    right = 0
    for g, w in zip(got, want, strict=False):
        if g != w:
            break
        right += 1
    return right / max(len(got), len(want), 1)


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact": exact_reward,
    "prefix_credit": prefix_credit_reward,
}

REWARDS_DIR = Path(__file__).resolve().parent.parent / "rewards"
SHARED_REWARDS: dict[str, tuple[str, str]] = {"gsm8k": ("gsm8k", "gsm8k_reward"),
                                              "gsm8k_flexible": ("gsm8k", "gsm8k_flexible_reward")}
"""`inflight.rewards`' rewards (registry name: module in inflight/rewards, function) that a data-file
workload's rows may name: loaded by path (`reward_for`) from files that import only the standard
library and each other relatively (neither extra_info nor anything else of the row is passed: these
rewards read none)."""
_SHARED_PACKAGE = "_inflight_rewards"


def reward_for(name: str) -> Callable[[str, str], float]:
    """The reward `name`: a built-in task's (`REWARDS`) or one of `SHARED_REWARDS`."""
    if name in REWARDS:
        return REWARDS[name]
    if name not in SHARED_REWARDS:
        raise KeyError(f"reward {name!r}: TRL's worker scores with {', '.join([*REWARDS, *SHARED_REWARDS])}")
    module, function = SHARED_REWARDS[name]
    return getattr(_shared_module(module), function)


def _shared_module(name: str) -> Any:
    """inflight/rewards/<name>.py as a module of a private package over that folder (its
    `__init__.py`, which imports the rest of inflight, not run)."""
    import importlib
    import types

    if _SHARED_PACKAGE not in sys.modules:
        package = types.ModuleType(_SHARED_PACKAGE, "inflight/rewards' files, loaded by path")
        package.__path__ = [str(REWARDS_DIR)]
        sys.modules[_SHARED_PACKAGE] = package
    return importlib.import_module(f"{_SHARED_PACKAGE}.{name}")


# ---- the run ------------------------------------------------------------------------------------
def versions() -> dict[str, Any]:
    """The interpreter and the installed versions of what the run uses (from their metadata: fast,
    nothing imported); PackageNotFoundError when one is missing."""
    from importlib.metadata import version

    return {"python": sys.version.split()[0], "executable": sys.executable,
            **{name: version(name) for name in ("trl", "transformers", "torch", "datasets", "accelerate")}}


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trl_prompt_ids(trainer: Any, rows: Sequence[dict[str, Any]]) -> list[list[int]]:
    """The token ids TRL's GRPOTrainer generates from for the rows' prompts: its own
    `_tokenize_prompts` (a text prompt through the tokenizer as is, a list of chat messages through
    the chat template with the generation prompt)."""
    return [list(ids) for ids in trainer._tokenize_prompts([r["prompt"] for r in rows])[0]]


def check_prompt_ids(ids: Sequence[Sequence[int]], rows: Sequence[dict[str, Any]]) -> None:
    """TRL's token ids of the rows' prompts (`trl_prompt_ids`) must be those inflight's engine is
    given, or the two sides would not see the same prompts."""
    for row, got in zip(rows, ids, strict=True):
        if list(got) != row["prompt_ids"]:
            raise ValueError(
                f"prompt {row['prompt']!r}: TRL's tokenization {list(got)} differs from inflight's "
                f"{row['prompt_ids']}; the two sides would not train on the same prompts"
            )


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text: TRL passes a text prompt's as a string, a chat prompt's as messages
    (the assistant's, decoded without special tokens as inflight's are)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


class Evaluator:
    """Greedy held-out accuracy of a model, as module docstring says, from the problems' token ids
    (those `check_prompt_ids` found equal to TRL's)."""

    def __init__(
        self,
        tokenizer: Any,
        problems: Sequence[dict[str, Any]],
        reward: Callable[[str, str], float],
        settings: dict[str, Any],
    ) -> None:
        from transformers import GenerationConfig

        self.tokenizer, self.problems, self.reward = tokenizer, problems, reward
        self.threshold, self.batch = settings["threshold"], settings["eval_batch_size"]
        self.config = GenerationConfig(
            do_sample=False,
            max_new_tokens=settings["eval_max_tokens"],
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

    def __call__(self, model: Any) -> tuple[float, float]:
        """(accuracy, seconds); leaves the model in the mode it found it in."""
        import torch

        started, correct, training = time.perf_counter(), 0, model.training
        model.eval()
        with torch.no_grad():
            for i in range(0, len(self.problems), self.batch):
                chunk = self.problems[i:i + self.batch]
                enc = self.tokenizer.pad({"input_ids": [p["prompt_ids"] for p in chunk]}, padding_side="left",
                                         return_tensors="pt")
                out = model.generate(**enc, generation_config=self.config)
                texts = self.tokenizer.batch_decode(
                    out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
                )
                correct += sum(self.reward(t, p["answer"]) >= self.threshold - 1e-9
                               for t, p in zip(texts, chunk, strict=True))
        model.train(training)
        return correct / len(self.problems), time.perf_counter() - started


def reward_function(
    reward: Callable[[str, str], float], stats: dict[str, float]
) -> Callable[..., list[float]]:
    """TRL's reward callable over a generation batch (the dataset's `answer` column comes as a
    keyword); notes the batch's mean reward and generated tokens in `stats`."""

    def score(
        completions: list[Any], answer: list[str], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        rewards = [reward(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]
        stats["reward"] = sum(rewards) / len(rewards)
        stats["generated_tokens"] = float(sum(len(ids) for ids in completion_ids))
        return rewards

    score.__name__ = "task_reward"
    return score


def grpo_config(settings: dict[str, Any]) -> Any:
    """TRL's GRPOConfig with the settings inflight's run has (see `trl_side.ALIGNED`): one
    optimizer step per generation batch of prompts x group, AdamW at a constant learning rate,
    PPO clip both ways, token-mean loss over the batch (`dapo`), no KL term, float32."""
    from trl import GRPOConfig

    group, prompts = settings["group_size"], settings["prompts_per_step"]
    return GRPOConfig(
        output_dir=settings["output_dir"],
        seed=settings["seed"],
        data_seed=settings["seed"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=prompts * group,
        gradient_accumulation_steps=1,
        num_generations=group,
        num_iterations=1,
        max_steps=settings["max_steps"],
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=settings["betas"][0],
        adam_beta2=settings["betas"][1],
        adam_epsilon=settings["adam_eps"],
        weight_decay=settings["weight_decay"],
        max_grad_norm=settings["max_grad_norm"],
        epsilon=settings["clip_low"],
        epsilon_high=settings["clip_high"],
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        max_completion_length=settings["max_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        top_k=settings["top_k"],
        min_p=settings["min_p"],
        repetition_penalty=settings["repetition_penalty"],
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


def run(settings: dict[str, Any]) -> dict[str, Any]:
    """One timed GRPO run; writes records.jsonl and summary.json into `output_dir`; returns the summary."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(settings["threads"])
    out = Path(settings["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(settings["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(settings["model_dir"], dtype=torch.float32)
    train_rows, eval_rows = read_jsonl(settings["train_file"]), read_jsonl(settings["eval_file"])
    reward = reward_for(settings["reward"])
    evaluate = Evaluator(tokenizer, eval_rows, reward, settings)
    stats: dict[str, float] = {}
    records = (out / "records.jsonl").open("w")

    def log(record: dict[str, Any]) -> None:
        records.write(json.dumps(record) + "\n")
        records.flush()

    samples_per_step = settings["prompts_per_step"] * settings["group_size"]
    clock: dict[str, float] = {}

    class Clock(TrainerCallback):
        """Starts the clock, records each step, evaluates every `eval_interval` steps, stops on time."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock["t0"], clock["cpu0"] = time.perf_counter(), _cpu_s()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter() - clock["t0"]
            log({"step": state.global_step, "time": now, "samples": samples_per_step, **stats})
            if settings["eval_interval"] > 0 and state.global_step % settings["eval_interval"] == 0:
                accuracy, took = evaluate(kwargs["model"])
                log({"step": state.global_step, "time": now, "eval/accuracy": accuracy, "eval/seconds": took})
            if time.perf_counter() - clock["t0"] >= settings["seconds"]:
                control.should_training_stop = True

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock["train_s"], clock["train_cpu_s"] = (
                time.perf_counter() - clock["t0"],
                _cpu_s() - clock["cpu0"],
            )

    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_function(reward, stats),
        args=grpo_config(settings),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
        peft_config=lora_config(settings),
    )
    check_prompt_ids(trl_prompt_ids(trainer, train_rows), train_rows)
    check_prompt_ids(trl_prompt_ids(trainer, eval_rows), eval_rows)
    before, seconds = evaluate(trainer.model)  # a LoRA model's adapters start at zero: the model as given
    log({"step": 0, "time": 0.0, "eval/accuracy": before, "eval/seconds": seconds})
    trainer.train()
    steps = trainer.state.global_step
    after, seconds = evaluate(trainer.model)
    log({"step": steps, "time": clock["train_s"], "eval/accuracy": after, "eval/seconds": seconds})
    records.close()
    samples = steps * samples_per_step
    summary = {
        "steps": steps,
        "train_seconds": clock["train_s"],
        "samples": samples,
        "samples_per_s": samples / max(clock["train_s"], 1e-9),
        "before": before,
        "after": after,
        "train_cpu_s": clock["train_cpu_s"],
        "threads": torch.get_num_threads(),
        "versions": versions(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def lora_config(settings: dict[str, Any]) -> Any:
    """peft's LoraConfig from the settings' `lora` (inflight's own keyword arguments,
    `inflight.train.lora.lora_kwargs`), or None: the whole model trains."""
    if not settings.get("lora"):
        return None
    from peft import LoraConfig

    return LoraConfig(**settings["lora"])


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    """`--hello`: the versions as one JSON line; else run the settings file given."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--hello"]:
        print(json.dumps(versions()))
        return 0
    if len(argv) != 1:
        print("usage: trl_worker.py --hello | trl_worker.py SETTINGS.json", file=sys.stderr)
        return 2
    run(json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    # run as a script, its folder leads sys.path: our `common.py` & co. must not shadow TRL's imports
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.exit(main())
