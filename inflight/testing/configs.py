"""A small, local baseline over SkyRL's defaults, for tests and benchmarks on one CPU machine.

SkyRL's defaults describe a GPU cluster (vLLM engines colocated with the trainer, bfloat16, a
KL-to-reference loss, batches of 1024 prompts, checkpoints every 10 steps under ~/ckpts). The tests
of the engine, the trainers and the weight sync run under these settings instead: the native
engine in float32 beside the trainer, the fully-async trainer on small batches, no reference model,
no checkpoints or trackers unless a test asks. A test states what it depends on by adding its own
overrides after these (`load_config(None, [*LOCAL_CPU, "trainer.fully_async.enabled=false"])`).
"""

from __future__ import annotations

LOCAL_CPU: tuple[str, ...] = (
    "generator.inference_engine.backend=native",
    "generator.inference_engine.model_dtype=float32",
    "generator.inference_engine.max_num_seqs=64",
    "generator.inference_engine.max_num_batched_tokens=2048",
    "generator.inference_engine.kv_cache_memory_gib=1.0",
    "trainer.placement.colocate_all=false",
    "trainer.fully_async.enabled=true",
    "trainer.fully_async.num_parallel_generation_workers=24",
    "trainer.train_batch_size=8",
    "trainer.policy_mini_batch_size=8",
    "generator.n_samples_per_prompt=4",
    "trainer.bf16=false",
    "trainer.gradient_checkpointing=false",
    "trainer.shared_prefix_forward=false",  # rows as they are: the tests of packing set it
    "trainer.policy.megatron_config.transformer_config_kwargs={}",  # SkyRL's recompute needs CUDA
    "trainer.algorithm.use_kl_loss=false",
    "trainer.algorithm.zero_variance_filter=true",
    "trainer.algorithm.off_policy_correction.tis_ratio_type=token",
    "trainer.algorithm.off_policy_correction.sequence_tis_ratio_clip_high=2.0",
    "trainer.logger=[console,tensorboard]",
    "trainer.print_example_interval=0",
    "trainer.ckpt_interval=-1",
    "trainer.resume_mode=null",
    "data.train_data=[]",
    "data.val_data=[]",
)
"""Overrides of SkyRL's defaults for a local CPU run (see the module docstring)."""

LOCAL_CPU_TRAINER: tuple[str, ...] = tuple(
    o for o in LOCAL_CPU if not o.startswith("generator.inference_engine.")
)
"""`LOCAL_CPU` without the engine keys: for runs on servers started elsewhere, whose own flags
decide those (a run refuses them away from their defaults)."""

