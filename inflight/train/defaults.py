"""The demo job (`examples/default.yaml`, `base: demo` in a config): fully-async GRPO on the built-in
addition task with the tiny base model, sized to learn visibly on 2 CPU cores in a few minutes
(the measured recipe: 16 prompts x 8 samples, temperature 1, lr 1e-4,
betas (0.9, 0.99), clip 0.2, gradient clip 1, token-mean loss, zero-advantage groups dropped)."""

from __future__ import annotations

from typing import Any

import yaml

DEFAULT_JOB_YAML = """\
# inflight's demo job (`scripts/run.sh`: `inflight train --config examples/default.yaml`).
# Fully-async GRPO with in-flight weight updates on the built-in addition task; the tiny base model
# is built and warmed up first because trainer.policy.model.path is null. Every key not set here
# takes SkyRL's default, as in any config; this file sets what the demo needs on 2 CPU cores.
trainer:
  strategy: fsdp                      # one process: the local worker (FSDP with world size 1)
  placement:
    colocate_all: false               # engine and trainer run side by side (fully async)
  train_batch_size: 16                # prompts per step
  policy_mini_batch_size: 16          # one optimizer step per training step
  micro_train_batch_size_per_gpu: 128 # the whole step in one forward/backward
  micro_forward_batch_size_per_gpu: 128
  epochs: 1
  max_training_steps: 2000
  seed: 42
  eval_interval: 100                  # held-out evaluation every 100 steps (in the plot), before and after
  bf16: false                         # float32 on CPU
  gradient_checkpointing: false       # the recompute costs more than the memory it saves on this model
  shared_prefix_forward: true         # each group's prompt runs once in the training forward, not 8 times
  logger: [console, tensorboard]
  print_example_interval: 100         # an example rollout printed every 100 steps (SkyRL: every step)
  ckpt_interval: -1                   # no checkpoints (set trainer.ckpt_path and an interval to save)
  resume_mode: null
  policy:
    model:
      path: null                      # null: build + warm up the tiny base model
    optimizer_config:
      lr: 1.0e-4
      adam_betas: [0.9, 0.99]
      weight_decay: 0.0
      max_grad_norm: 1.0
  algorithm:
    advantage_estimator: grpo
    eps_clip_low: 0.2
    eps_clip_high: 0.2
    loss_reduction: token_mean
    use_kl_loss: false
    zero_variance_filter: true        # groups whose rewards are all equal carry no signal
    off_policy_correction:
      tis_ratio_type: token           # truncated importance sampling for tokens older than the policy
      token_tis_ratio_clip_high: 2.0
  fully_async:
    enabled: true
    max_staleness_steps: 1            # generate the next batch while training on this one
    num_parallel_generation_workers: 32
    clear_kv_cache_on_weight_sync: false   # KV fate: keep
generator:
  n_samples_per_prompt: 8
  eval_n_samples_per_prompt: 1        # evaluation: one greedy sample per held-out problem (pass@1 = accuracy)
  eval_sampling_params:
    temperature: 0.0
  sampling_params:
    temperature: 1.0
    max_generate_length: 8
  inference_engine:
    backend: native                   # this project's paged-KV engine
    model_dtype: float32
    weight_sync_backend: shm          # engine in its own process, weights via one shared buffer
    offload_kv_for_weight_sync: false
    enable_prefix_caching: true
    max_num_seqs: 256
    max_num_batched_tokens: 4096
    max_model_len: 64
    kv_cache_memory_gib: 0.05
job:
  task: addition
  num_train: 40000                    # training problems (the held-out 200 are never among them)
  max_train_seconds: 1800             # a cap only: the 2,000 steps are RL's budget (~2 min on 2 quiet vCPUs)
  output_dir: runs/inflight
  warmup_steps: 300                   # the supervised warm-up's budget (~30 s on 2 quiet vCPUs)
  warmup_max_seconds: 1200            # a cap only, said when it ends the warm-up early
  warmup_target_accuracy: null        # no early stop: every machine starts RL from the same model
"""


TASK_OVERRIDES: dict[str, list[str]] = {
    # count_up answers run to 65 tokens (prompt <= 8): room to generate them, KV for 256 of them; its
    # warm-up stops at 30% accuracy (checked every 25 steps, at most 400: work, not time) and its steps
    # cost ~3x addition's: a longer cap
    "count_up": [
        "generator.sampling_params.max_generate_length=72",
        "generator.inference_engine.max_model_len=128",
        "generator.inference_engine.kv_cache_memory_gib=0.1",
        "job.warmup_steps=400",
        "job.warmup_target_accuracy=0.3",
        "job.warmup_max_seconds=3600",
    ],
}
"""Overrides of the default job that a built-in task needs (`examples/count_up.yaml` has them)."""


def task_overrides(task: str) -> list[str]:
    """`job.task=<task>` and the overrides of the default job that `task` needs."""
    return [f"job.task={task}", *TASK_OVERRIDES.get(task, [])]


def default_job() -> dict[str, Any]:
    """The demo job as a mapping (`examples/default.yaml`; `base: demo` in a config)."""
    return yaml.safe_load(DEFAULT_JOB_YAML)
