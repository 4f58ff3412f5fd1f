"""The tiny base model for the built-in task, and its supervised warm-up.

`build_base_model` writes a random Qwen2-shaped model (hidden 128, 4 layers, 4 heads, 2 KV heads,
MLP 512, tied embeddings: about 0.8M parameters) with the character tokenizer as a Hugging Face
directory; `arch="qwen3_moe"` / `"qwen2_moe"` gives a mixture of experts of the same shape whose
every MLP is 8 experts of 128, 2 per token (`MOE_SHAPE`; Qwen2-MoE adds its gated shared expert
of 256), as many active MLP parameters per token as half the dense MLP. `warm_up` trains it on a task's
problems (`a+b=` -> sum + EOS for addition) with teacher forcing (loss on the answer tokens, long-tailed
batches in length buckets) for a fixed number of steps, so that RL still has room to improve it and every
machine starts RL from the same model (a time cap only ends a warm-up that runs too long, and the report says
so), and saves it back where the engine can load it. A vision-language model's directory (a `vision_config`,
e.g. `testing.tiny_vlm`) warms up the same way on a task whose prompts hold images (`task.vision`: the prompts
through its processor, the images into the forward). Measured on 2 CPU cores: 300 steps (~45 s) give ~30-40%
greedy accuracy; a 0.1M model plateaus near 55%, which is why the model is this size.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from inflight.chat.images import count_images
from inflight.chat.vision import auto_model_class
from inflight.tasks.addition import AdditionTask
from inflight.tasks.base import Problem, Task
from inflight.tasks.dataset import image_prompt
from inflight.tasks.tokenizer import make_char_tokenizer

BASE_MODEL_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    tie_word_embeddings=True,
    max_position_embeddings=128,  # room for count_up's ~100-token answers; no parameters depend on it
)


MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
"""The mixtures of experts' MLPs (`arch` qwen3_moe / qwen2_moe), on top of `BASE_MODEL_SHAPE`."""
ARCHS = {
    "qwen2": (Qwen2Config, {}),
    "qwen3_moe": (Qwen3MoeConfig, dict(MOE_SHAPE, norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, dict(MOE_SHAPE, norm_topk_prob=False, shared_expert_intermediate_size=256)),
}
"""`build_base_model`'s architectures (`job.arch`): config class and what they add to the shape."""


def build_base_model(
    path: str | Path, seed: int = 0, tokenizer=None, arch: str = "qwen2", **overrides
) -> Path:
    """Write a random-init model of `arch` (`ARCHS`: qwen2, qwen3_moe, qwen2_moe) and `tokenizer`
    (default: the addition character tokenizer; give the task's for other tasks) to `path`; returns
    it. `overrides` go into the config (e.g. hidden_size=64 for tests)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown base model arch {arch!r}; one of {', '.join(ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else make_char_tokenizer()
    config_class, extra = ARCHS[arch]
    shape = BASE_MODEL_SHAPE | extra | overrides
    if arch == "qwen3_moe":
        shape.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    config = config_class(
        vocab_size=len(tokenizer),
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_model(model, tokenizer, path)
    return path


def save_model(model: torch.nn.Module, tokenizer, path: str | Path) -> None:
    """Save model + tokenizer as an HF directory with EOS/PAD in the generation config."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def load_for_training(model_dir: str | Path) -> torch.nn.Module:
    """The model in `model_dir` in float32: a causal LM, or a vision-language model (its config has a
    `vision_config`) through `AutoModelForImageTextToText`."""
    auto = auto_model_class(AutoConfig.from_pretrained(str(model_dir)))
    return auto.from_pretrained(str(model_dir), dtype=torch.float32)


def _prompt(task: Task, prompt: str | list[dict]) -> tuple[list[int], Any]:
    """A prompt's ids, and the processor's output for its images (None without)."""
    if isinstance(prompt, str) or not count_images(prompt):
        return task.encode_prompt(prompt), None
    out = image_prompt(task, prompt)
    return out.token_ids, out


def supervised_batch(task: Task, problems: Sequence[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded `prompt + answer + EOS` ids, with labels only on answer and EOS tokens
    (`-100` elsewhere, so `labels[:, t]` is the target predicted at position t - 1). Prompts with
    images add the forward's `pixel_values`, `image_grid_thw` and `mm_token_type_ids`."""
    eos, pad = task.tokenizer.eos_token_id, task.tokenizer.pad_token_id
    rows, labels, images = [], [], []
    for p in problems:
        (prompt, pictures), answer = _prompt(task, p.prompt), task.encode(p.answer) + [eos]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
        images += [pictures] if pictures is not None else []
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)], lab[i, : len(lb)], mask[i, : len(r)] = torch.tensor(r), torch.tensor(lb), 1
    batch = {"input_ids": ids, "labels": lab, "attention_mask": mask}
    if images:
        image_token = task.vision.processor.image_token_id
        batch.update(pixel_values=torch.cat([im.pixel_values for im in images]),
                     image_grid_thw=torch.cat([im.image_grid_thw for im in images]),
                     mm_token_type_ids=ids.eq(image_token).int())
    return batch


@torch.no_grad()
def teacher_forced_accuracy(model: torch.nn.Module, task: Task, problems: Sequence[Problem]) -> float:
    """Greedy exact-match accuracy without generating: greedy decoding yields exactly `answer + EOS`
    iff the argmax at every answer position (given the true prefix) is the true next token. One
    forward pass instead of one per token."""
    model.eval()
    batch = supervised_batch(task, problems)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    pred, target = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    ok = ((pred == target) | (target == -100)).all(dim=1)
    return float(ok.float().mean())


def length_buckets(lengths: Sequence[int], parts: int = 4, keep: float = 0.75) -> list[list[int]]:
    """Indices of `lengths` in `parts` groups of neighbouring lengths when that pads to at most
    `keep` of the tokens one right-padded batch would (long-tailed lengths); else one group."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    size = -(-len(order) // parts)
    groups = [order[i:i + size] for i in range(0, len(order), size)]
    padded = sum(len(g) * lengths[g[-1]] for g in groups)
    return groups if padded <= keep * len(lengths) * max(lengths, default=0) else [list(range(len(lengths)))]


def supervised_backward(model: torch.nn.Module, task: Task, problems: Sequence[Problem]) -> float:
    """Accumulate the gradient of the mean answer-token loss over `problems` (in length buckets,
    each weighted by its share of the answer tokens, so the mean is that of one batch); returns it."""
    lengths = [len(_prompt(task, p.prompt)[0]) + len(task.encode(p.answer)) + 1 for p in problems]
    batches = [supervised_batch(task, [problems[i] for i in g]) for g in length_buckets(lengths)]
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    total = 0.0
    for batch, count in zip(batches, counts, strict=True):
        loss = model(**batch).loss * (count / sum(counts))
        loss.backward()
        total += float(loss.detach())
    return total


@dataclass
class WarmupReport:
    steps: int
    seconds: float
    accuracy: float
    loss: float
    stopped_by: str  # "steps" | "time" | "accuracy"
    steps_asked: int = 0  # the warm-up's budget (`steps`): fewer done means a cap or the target ended it


def warm_up(
    model_dir: str | Path,
    task: Task | None = None,
    steps: int = 300,
    batch_size: int = 128,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.98),
    max_seconds: float | None = None,
    target_accuracy: float | None = None,
    eval_every: int = 25,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> WarmupReport:
    """Supervised warm-up of the model in `model_dir` on `task`'s problem distribution (never its
    held-out set); saves the result back to `model_dir`. Runs `steps` steps, the budget: the same
    model on a busy machine as on a quiet one. `max_seconds` is a cap only, for a warm-up that would
    run too long: when it ends the warm-up before its steps, `log` gets a line saying so and the
    report's `stopped_by` is "time". With `target_accuracy`, it stops once the teacher-forced greedy
    accuracy on the held-out set reaches it (checked every `eval_every` steps).

    `threads`: torch threads; None keeps the current setting, 0 picks by measuring: the first
    steps run with 2 threads, then with 1, and the faster setting stays. (On 2 vCPUs, 2 threads
    are ~2x faster on an idle machine but collapse when another process is busy, because OpenMP
    threads spin-wait for each other.)"""
    task = task or AdditionTask()
    torch.manual_seed(seed)
    rng = random.Random(seed + 17)
    model = load_for_training(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    started = time.perf_counter()
    accuracy, loss_value, stopped_by, step = 0.0, float("nan"), "steps", 0
    evals = task.eval_problems()
    probe = _ThreadProbe(threads)
    for step in range(1, steps + 1):
        probe.before(step)
        model.train()
        loss_value = supervised_backward(model, task, task.sample_problems(rng, batch_size))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        probe.after(step, log)
        elapsed = time.perf_counter() - started
        if step % eval_every == 0 or step == steps:
            accuracy = teacher_forced_accuracy(model, task, evals)
            if log is not None:
                log(f"warm-up step {step}: loss {loss_value:.3f}, accuracy {accuracy:.1%}, {elapsed:.0f}s")
            if target_accuracy is not None and accuracy >= target_accuracy:
                stopped_by = "accuracy"
                break
        if max_seconds is not None and elapsed >= max_seconds and step < steps:
            stopped_by = "time"
            accuracy = teacher_forced_accuracy(model, task, evals)
            if log is not None:
                log(
                    f"warm-up stopped by its time cap ({max_seconds:g} s) after step {step} of {steps} (a "
                    f"slow or busy machine): the model is less trained than its {steps} steps make it"
                )
            break
    save_model(model, task.tokenizer, model_dir)
    return WarmupReport(step, time.perf_counter() - started, accuracy, loss_value, stopped_by, steps)


class _ThreadProbe:
    """Times steps 2-3 with 1 torch thread and steps 5-6 with 2 (steps 1 and 4 warm up), then keeps
    the faster; gives up on 2 at once when step 4 alone is much slower than 1 thread's steps."""

    ONE, TWO = (1, 2, 3), (4, 5, 6)

    def __init__(self, threads: int | None) -> None:
        self.auto = threads == 0
        if threads:
            torch.set_num_threads(threads)
        self.times: dict[int, list[float]] = {1: [], 2: []}
        self.t0 = 0.0

    def before(self, step: int) -> None:
        if not self.auto:
            return
        if step in self.ONE or step in self.TWO:
            torch.set_num_threads(1 if step in self.ONE else 2)
            self.t0 = time.perf_counter()

    def after(self, step: int, log: Callable[[str], None] | None) -> None:
        if not self.auto or not (step in self.ONE or step in self.TWO):
            return
        took = time.perf_counter() - self.t0
        one = sum(self.times[1]) / max(len(self.times[1]), 1)
        if step == self.TWO[0] and took > 3 * one:  # 2 threads are fighting something: stop now
            self._choose(
                1, log, f"2 threads took {1000 * took:.0f} ms for one step, 1 thread {1000 * one:.0f} ms"
            )
        elif step not in (self.ONE[0], self.TWO[0]):
            self.times[1 if step in self.ONE else 2].append(took)
            if step == self.TWO[-1]:
                two = sum(self.times[2]) / len(self.times[2])
                self._choose(2 if two < one else 1, log,
                             f"{1000 * two:.0f} ms/step with 2, {1000 * one:.0f} ms/step with 1")

    def _choose(self, threads: int, log: Callable[[str], None] | None, why: str) -> None:
        self.auto = False
        torch.set_num_threads(threads)
        if log is not None:
            log(f"warm-up threads: {threads} ({why})")
