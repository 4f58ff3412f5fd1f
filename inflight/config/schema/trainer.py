"""The training loop (SkyRL: `trainer`): placement, fully-async training, batch sizes, run length,
checkpoints, evaluation and logging."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from inflight.config.schema.algorithm import AlgorithmConfig
from inflight.config.schema.models import CriticConfig, PolicyConfig, RefConfig
from inflight.config.status import accepted, example, ours, refused, skyrl

STRATEGY_ALIASES = {"fsdp2": "fsdp"}


def canonical_strategy(name: str) -> str:
    """`fsdp2` -> `fsdp`; anything else unchanged."""
    return STRATEGY_ALIASES.get(name, name) if isinstance(name, str) else name


_BESIDE_POLICY = "it runs beside the policy, on the policy's ranks (no ranks of its own)"


@dataclass
class PlacementConfig:
    """Where trainer and engines run."""

    colocate_all: bool = skyrl(True)
    """Trainer and engines share the devices: the engines sleep while the trainer trains
    (synchronous trainer only). Default true."""
    colocate_policy_ref: bool = skyrl(True, status=refused(
        "a reference model on devices of its own is not implemented: " + _BESIDE_POLICY,
        runs=lambda v: v is True, fix="set trainer.placement.colocate_policy_ref=true"))
    policy_num_nodes: int = skyrl(1)
    """Nodes the policy workers run on, >= 1. Default 1."""
    policy_num_gpus_per_node: int = skyrl(1)
    """Policy ranks per node (GPUs; processes on CPU), >= 1. Default 1. The policy has
    policy_num_nodes * policy_num_gpus_per_node ranks."""
    critic_num_nodes: int = skyrl(1, status=refused("a critic on nodes of its own is not implemented: "
                                                    + _BESIDE_POLICY, runs=lambda v: v == 1))
    critic_num_gpus_per_node: int = skyrl(
        1,
        status=refused(
            "a critic on devices of its own is not implemented: " + _BESIDE_POLICY, runs=lambda v: v == 1
        ),
    )
    ref_num_nodes: int = skyrl(1, status=refused("a reference model on nodes of its own is not implemented: "
                                                 + _BESIDE_POLICY, runs=lambda v: v == 1))
    ref_num_gpus_per_node: int = skyrl(
        1,
        status=refused(
            "a reference model on devices of its own is not implemented: " + _BESIDE_POLICY,
            runs=lambda v: v == 1,
        ),
    )
    reward_num_nodes: int = example(1, status=refused("a reward model on nodes of its own (SkyRL's LLM-judge "
                                                      "example) is not implemented", runs=lambda v: v == 1))
    """Nodes of the reward model of SkyRL's LLM-as-a-judge example. Default 1."""


@dataclass
class FullyAsyncConfig:
    """Fully-async training: generation continues while the trainer steps; weights sync in flight."""

    enabled: bool = skyrl(False)
    """Run the fully-async trainer. Default false."""
    max_staleness_steps: int = skyrl(4)
    """A trajectory group scheduled at step i is trained at step j <= i + max_staleness_steps. Default 4."""
    num_parallel_generation_workers: int = skyrl(768)
    """Concurrent generation groups; policy_mini_batch_size <= this <= policy_mini_batch_size *
    (max_staleness_steps + 1). Default 768."""
    sample_full_batch: bool = skyrl(False)
    """Drop zero-variance groups at generation (needs zero_variance_filter) and keep generating
    until the mini-batch is full of informative ones (asynchronous DAPO dynamic sampling); the
    dropped prompts are consumed. Default false."""
    clear_kv_cache_on_weight_sync: bool = skyrl(False)
    """Drop the KV of in-flight requests on every sync: they are reset and re-prefilled with the new
    weights (fate `recompute`). Default false: they keep KV from older weights (fate `keep`)."""
    simulate_training: bool = skyrl(False, status=refused(
        "the simulated trainer is not implemented yet", runs=lambda v: v is False))
    simulate_training_step_seconds: float = skyrl(30.0, status=accepted(
        "read only with simulate_training=true, which is refused"))
    simulate_weight_sync_seconds: float = skyrl(0.0, status=accepted(
        "read only with simulate_training=true, which is refused"))
    engine_restarts: int = ours(0)
    """How many times per run a dead engine process is restarted: the new process loads the
    engines' model, a full weight sync brings it to the current weights, and the groups it was
    generating are generated again (never trained on, so none is lost or trained twice). 0
    (default): the run stops with an error naming the engine. Needs engines in their own processes
    (weight_sync_backend `shm` or `broadcast`)."""


_MTP = accepted("read only with trainer.mtp.enabled=true, which is refused")


@dataclass
class MTPConfig:
    """Multi-token-prediction draft heads (not implemented: enabled is refused)."""

    enabled: bool = skyrl(False, status=refused("multi-token-prediction heads are not implemented",
                                                runs=lambda v: v is False))
    num_speculative_tokens: int = skyrl(1, status=_MTP)
    loss_weight: float = skyrl(0.1, status=_MTP)


@dataclass
class TrainerConfig:
    """The training loop and the policy workers."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    use_expandable_segments: bool = skyrl(True)
    """CUDA's `expandable_segments` allocator in the trainer's process (set before CUDA starts).
    Default true. On CPU there is no CUDA allocator."""
    sequence_parallel_backend: str = skyrl("ulysses", choices=("ulysses",), status=accepted(
        "read only with sequence_parallel_size > 1, which is refused"))
    strategy: str = skyrl("fsdp", choices=("fsdp", "megatron"), aliases=STRATEGY_ALIASES)
    """`fsdp` (default) or `megatron`; SkyRL's `fsdp2` is read as `fsdp`."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)
    gradient_checkpointing: bool = skyrl(True)
    """Recompute each decoder layer's activations in the backward instead of keeping them. Default
    true (on small CPU models the recompute costs more than the memory saves: the demo turns it off)."""
    gradient_checkpointing_use_reentrant: bool = skyrl(False)
    """torch.utils.checkpoint's `use_reentrant`. Default false."""
    seed: int = skyrl(42)
    """Seed for data order, sampling and initialisation, >= 0. Default 42."""
    resume_mode: str | None = skyrl("latest")
    """`latest` (default: resume from the newest checkpoint in ckpt_path when there is one),
    `from_path` (from resume_path) or null / `none` (start afresh)."""
    resume_path: str | None = skyrl(None)
    """The checkpoint (`<ckpt_path>/global_step_<k>`) of resume_mode=from_path. Default none."""
    log_path: str = skyrl("/tmp/skyrl-logs")
    """Where the run's infrastructure logs go (the engine servers' output). Default /tmp/skyrl-logs."""
    ckpt_path: str = skyrl(factory=lambda: os.path.expanduser("~/ckpts/"))
    """Directory of the resumable checkpoints. Default ~/ckpts/."""
    max_ckpts_to_keep: int = skyrl(-1)
    """Keep only the newest N checkpoints; -1 (default): all."""
    ckpt_interval: int = skyrl(10)
    """Save a checkpoint every this many steps (and after the last); -1 or 0: never. Default 10."""
    hf_save_interval: int = skyrl(-1)
    """Export the policy as a Hugging Face model (in the model's own dtype; LoRA: merged, plus the
    adapter) every this many steps and after the last one; -1 (default) or 0: never."""
    export_path: str = skyrl(factory=lambda: os.path.expanduser("~/exports/"))
    """Where the exports go (`<export_path>/global_step_<k>/`). Default ~/exports/."""
    bf16: bool | None = skyrl(True)
    """Train in bfloat16 over float32 master weights and optimizer state (autocast for the local
    worker, FSDP2's MixedPrecisionPolicy, Megatron's bf16). Default true. On a CPU without native
    bfloat16 matmuls (neither AMX nor AVX-512-BF16) they are emulated and slower than float32: set
    false there, or null (ours): bfloat16 where the device computes it natively (CUDA, a CPU with
    AMX or AVX-512-BF16), float32 elsewhere; a run prints which it chose and why."""
    epochs: int = skyrl(1)
    """Passes over the training data, >= 1. The run ends after them, or sooner at max_training_steps.
    Default 1."""
    max_training_steps: int | None = skyrl(None)
    """At most this many training steps: the run ends at the end of its epochs or at this step, whichever
    comes first (SkyRL's cap; to train longer, raise trainer.epochs). null (default): the epochs."""
    update_epochs_per_batch: int = skyrl(1)
    """Passes over each training batch, >= 1. Default 1."""
    train_batch_size: int = skyrl(1024)
    """Prompts per training step, >= 1. Default 1024."""
    policy_mini_batch_size: int = skyrl(256)
    """Prompts per optimizer step, >= 1, divides train_batch_size. Default 256."""
    critic_mini_batch_size: int = skyrl(256)
    """Prompts per optimizer step of the critic (trained before the policy in every step), >= 1,
    divides train_batch_size. Default 256."""
    micro_train_batch_size_per_gpu: int = skyrl(1)
    """Sequences per forward/backward on one rank, >= 1. Default 1."""
    micro_forward_batch_size_per_gpu: int = skyrl(1)
    """Sequences per forward without gradients (reference log-probabilities, critic values, and old
    log-probabilities when recompute_old_logprobs_per_minibatch=false) on one rank, >= 1. Default 1."""
    max_tokens_per_microbatch: int = skyrl(-1)
    """Cap on the padded tokens (rows x longest row) of one forward(/backward), besides the
    micro-batch sizes; a longer row runs alone. -1 (default): no cap."""
    recompute_old_logprobs_per_minibatch: bool = skyrl(True)
    """When the old log-probabilities need a forward of their own, take it in the training passes'
    own micro-batches, mini-batch by mini-batch (true, default), or in one pass over the whole batch in
    forward micro-batches (false). (A step with one optimizer step needs none: its training forward is
    the old policy.)"""
    update_ref_every_epoch: bool = skyrl(False)
    """Copy the policy's weights into the reference model once an epoch is trained (before the first
    step made only of the next epoch's prompts). Needs a reference model. Default false."""
    remove_microbatch_padding: bool = skyrl(True, status=accepted(
        "a micro-batch's rows are sorted by length and padded only to its own longest row, whatever "
        "this says; packing rows into one (THD) needs flash-attention's varlen kernels (CUDA)"))
    eval_batch_size: int = skyrl(1024)
    """Held-out prompts evaluated at once, >= 1 (the rest wait). Default 1024."""
    eval_before_train: bool = skyrl(True)
    """Evaluate before the first step (when eval_interval > 0). Default true."""
    eval_interval: int = skyrl(5)
    """Evaluate on the held-out sets every this many steps and after the last; -1 or 0 turns
    evaluation off. Default 5."""
    max_prompt_length: int = skyrl(512)
    """Longest prompt in tokens (after the chat template), >= 1; longer ones are dropped and counted
    (or refused: data.drop_long_prompts=false). Default 512."""
    flash_attn: bool = skyrl(True)
    """The training forward's attention: flash-attention 2 where the policy runs on CUDA with
    `flash-attn` installed, else PyTorch's SDPA (the same attention, another kernel); false: SDPA.
    Default true."""
    disable_fast_tokenizer: bool = skyrl(False)
    """Load the slow (Python) tokenizer instead of the fast one. Default false."""
    project_name: str = skyrl("skyrl")
    """The tracker's project (W&B project, MLflow experiment). Default skyrl."""
    run_name: str = skyrl("test_run")
    """The tracker's run name. Default test_run."""
    logger: list[str] = skyrl(factory=lambda: ["wandb"])
    """Experiment trackers: any of `console` (progress bar), `tensorboard`, `wandb` (offline when
    no API key is set), `mlflow`; one name, a comma list or a list. Default wandb. The metrics
    JSONL is always written."""
    enable_ray_gpu_monitor: bool = skyrl(True)
    """Add the process's memory (resident set; CUDA: allocated and reserved) to every step's metrics
    (`system/...`). Default true."""
    tags: list[str] | None = skyrl(None)
    """Tags of the tracker's run (W&B tags, MLflow tags). Default none."""
    dump_data_batch: bool = skyrl(False)
    """Write every training batch to `<job.output_dir>/dumped_data/step_<k>.jsonl`, one line per
    trajectory: its episode id (`<prompt id>:<epoch>:<sample>`), token ids, loss mask, rollout
    log-probabilities, weight versions, reward, finish reason, why its harness failed, and, with
    `generator.inference_engine.enable_return_routed_experts`, its mixture-of-experts routing
    record (`inflight.train.step_records.dump_batch` says how to read it back). Default false."""
    dump_eval_results: bool = skyrl(True)
    """Write each evaluation's samples.jsonl and metrics.json to <job.output_dir>/eval/step_<k>/.
    Default true."""
    print_example_interval: int = skyrl(1)
    """Print one example prompt, response and reward every this many steps; 0 or -1: never. Default 1."""
    num_logger_eval_samples: int = skyrl(-1, status=refused(
        "sample tables in the trackers are not implemented yet (evaluations write samples.jsonl)",
        runs=lambda v: v <= 0))
    num_logger_train_samples: int = skyrl(-1, status=refused(
        "sample tables in the trackers are not implemented yet (trainer.dump_data_batch writes them)",
        runs=lambda v: v <= 0))
    log_example_interval: int = skyrl(-1)
    """SkyRL's old name of print_example_interval; > 0 sets it. Default -1."""
    logprobs_chunk_size: int | None = skyrl(1024)
    """Tokens per chunk of the training forward's log-probabilities, >= 1: the LM head and the
    log-softmax over the vocabulary run a chunk at a time under activation checkpointing, so the
    [tokens, vocabulary] float32 logits never exist at once (the same values and gradients; the LM
    head's matmul runs once more in the backward). null: the whole micro-batch at once. Default
    1024. The local worker (one policy rank); FSDP runs the full logits, megatron its
    vocab-parallel cross-entropy: neither chunks yet."""
    vocab_entropy_chunk_size: int = skyrl(
        0,
        status=refused(
            "the entropy is not chunked over the vocabulary (the local worker takes it with the "
            "log-probabilities, trainer.logprobs_chunk_size tokens at a time, so the full logits never "
            "exist)",
            runs=lambda v: v == 0,
        ),
    )
    vocab_entropy_chunk_memory_mb: int = skyrl(512, status=accepted(
        "read only with vocab_entropy_chunk_size > 0, which is refused"))
    fused_lm_head_logprob: bool = skyrl(False, status=refused(
        "Megatron's fused LM-head log-probabilities are not implemented (the local worker always takes "
        "them chunk-wise through the LM head: logprobs_chunk_size)", runs=lambda v: v is False))
    fused_lm_head_logprob_backend: str = skyrl("torch", choices=("torch", "triton"), status=refused(
        "triton kernels need CUDA; only torch runs", runs=lambda v: v == "torch"))
    micro_batch_pass_tokens: float = ours(64.0)
    """What one more forward/backward costs, in padded tokens, >= 0: a rank's rows of a mini-batch,
    sorted by length, are cut into micro-batches where padded tokens plus this per pass are fewest.
    64 (default) is about a pass's fixed cost on the small CPU models; .inf: the fewest passes."""
    shared_prefix_forward: bool = ours(True)
    """The rows of a micro-batch that begin with the same context (a group's prompt) run as one
    sequence, the context once, each row's tokens after it, under a tree attention mask
    (`inflight.train.shared_prefix`): the same log-probabilities and gradients for fewer tokens, and
    micro-batches cut by group. Packed only where the tokens saved outweigh the longer sequence's
    attention. The local and FSDP workers with PyTorch's SDPA, full attention in every layer, no
    mixture of experts; elsewhere rows run as they are. Default true (where it packs nothing, rows run
    as they are; false: never pack, micro-batches cut by length alone)."""
    correct_threshold: float = ours(1.0)
    """A trajectory counts as correct (the `accuracy` metric) when its reward is at least this.
    Default 1.0."""
    moe_logprob_gap_interval: int = ours(10)
    """Mixture-of-experts rollouts with a routing record: every this many training steps (the first
    included), two forwards without gradients, with and without routing replay, measure the mean
    |trainer - rollout| log-probability of the trained tokens (`moe/logprob_gap_replay`,
    `moe/logprob_gap_no_replay`), >= 0; 0: never. Default 10."""

    def __post_init__(self) -> None:
        self.strategy = canonical_strategy(self.strategy)


__all__ = ["STRATEGY_ALIASES", "FullyAsyncConfig", "MTPConfig", "PlacementConfig", "TrainerConfig",
           "canonical_strategy"]
