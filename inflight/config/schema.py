"""The typed configuration schema: nested dataclasses whose dotted paths are the config keys.

Key names follow SkyRL's (`trainer.placement.colocate_all`, `trainer.fully_async.enabled`,
`generator.inference_engine.offload_kv_for_weight_sync`, ...) so a SkyRL user's block works
unchanged. Every field documents its default. Two defaults differ from SkyRL's on purpose: this
project is fully-async first, so `trainer.placement.colocate_all` defaults to false and
`trainer.fully_async.enabled` to true (SkyRL: true / false); the others are listed where they are.

Every key is read by the code, or refused at run time by `inflight.config.implemented` (keys SkyRL
has that this project does not implement yet: `tensor_parallel_size > 1`; LoRA on megatron or
several policy ranks is refused by the validation). The engine's
settings are derived from `generator.inference_engine` by field name
(`inflight.train.engine_settings.engine_config`), the training step's from `trainer.*`
(`inflight.train.step.StepOptions.from_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Values SkyRL users write, mapped to ours. Applied on construction; `validate` accepts both.
STRATEGY_ALIASES = {"fsdp2": "fsdp"}
WEIGHT_SYNC_BACKEND_ALIASES = {"nccl": "broadcast", "gloo": "broadcast", "cuda_ipc": "shm"}


def canonical_strategy(name: str) -> str:
    """`fsdp2` -> `fsdp`; anything else unchanged."""
    return STRATEGY_ALIASES.get(name, name) if isinstance(name, str) else name


def canonical_weight_sync_backend(name: str) -> str:
    """`nccl`/`gloo` -> `broadcast`, `cuda_ipc` -> `shm`; anything else unchanged."""
    return WEIGHT_SYNC_BACKEND_ALIASES.get(name, name) if isinstance(name, str) else name


@dataclass
class PlacementConfig:
    """Where trainer and engines run."""

    colocate_all: bool = False
    """Trainer and engines share devices; the engine sleeps while the trainer trains. Synchronous
    trainer only. Default false (SkyRL: true)."""
    policy_num_nodes: int = 1
    """Nodes the policy workers run on, >= 1. Default 1."""
    policy_num_gpus_per_node: int = 1
    """Policy ranks per node (GPUs; processes on CPU), >= 1. Default 1. The policy has
    policy_num_nodes * policy_num_gpus_per_node ranks."""


@dataclass
class FullyAsyncConfig:
    """Fully-async training: generation continues while the trainer steps; weights sync in flight."""

    enabled: bool = True
    """Run the fully-async trainer. Default true (SkyRL: false)."""
    max_staleness_steps: int = 4
    """A trajectory group scheduled at step i is trained at step j <= i + max_staleness_steps. Default 4."""
    num_parallel_generation_workers: int = 24
    """Concurrent generation groups; policy_mini_batch_size <= this <= policy_mini_batch_size *
    (max_staleness_steps + 1). Default 24 (= 8 * (4 / 2 + 1), SkyRL's rule of thumb)."""
    clear_kv_cache_on_weight_sync: bool = False
    """Drop the KV of in-flight requests on every sync: they are reset and re-prefilled with the new
    weights (fate `recompute`). Default false: they keep KV from older weights (fate `keep`)."""
    engine_restarts: int = 0
    """How many times per run a dead engine process is restarted (not a SkyRL key): the new process
    loads the engines' model, a full weight sync brings it to the current weights, and the groups
    it was generating are generated again (never trained on, so none is lost or trained twice).
    0 (default): the run stops with an error naming the engine. Needs engines in their own
    processes (weight_sync_backend `shm` or `broadcast`)."""


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (`peft`): only the adapters train, and each weight sync sends the
    adapter, which the engines merge into their base weights."""

    rank: int = 0
    """Rank of the adapters; 0 (default) disables LoRA."""
    alpha: int = 16
    """LoRA scaling alpha (the update is scaled by alpha / rank). Default 16."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training, in [0, 1). Default 0."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: `all-linear` (default, SkyRL's: every linear layer but the LM head)
    or module names (`q_proj,v_proj`)."""


@dataclass
class ModelConfig:
    """The policy model."""

    path: str | None = None
    """Hugging Face model id or local directory. Default none (required to train)."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class OptimizerConfig:
    """AdamW settings."""

    lr: float = 1e-6
    """Learning rate, > 0. Default 1e-6."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas, two values in [0, 1). Default [0.9, 0.999]."""
    weight_decay: float = 1e-2
    """AdamW weight decay, >= 0. Default 0.01."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm, > 0. Default 1.0."""
    scheduler: str = "constant_with_warmup"
    """Learning-rate schedule over the optimizer steps (transformers' `get_scheduler`): `constant`,
    `constant_with_warmup` (default, SkyRL's), `linear` or `cosine` (these two decay to 0 at the
    run's last step, `job.max_steps`)."""
    num_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`, >= 0. Default 0."""


@dataclass
class MegatronConfig:
    """The Megatron backend (`trainer.strategy=megatron`)."""

    tensor_model_parallel_size: int = 1
    """Ranks each layer is split over, >= 1; must divide the policy's ranks (the rest is data
    parallelism) and the model's attention and KV heads. Default 1."""


@dataclass
class PolicyConfig:
    """The trained policy."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    megatron_config: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class OffPolicyCorrectionConfig:
    """Truncated importance sampling (TIS) of tokens sampled by older weights than the trainer's
    (SkyRL: `trainer.algorithm.off_policy_correction`)."""

    tis_ratio_type: str | None = "token"
    """`token` (default; SkyRL: null), `sequence`, or null (also `none`) for no correction.
    `job.tis` is an alias of this key."""
    token_tis_ratio_clip_high: float = 2.0
    """Cap of the token-level importance weights, > 0. Default 2.0. `job.tis_cap` sets both caps."""
    sequence_tis_ratio_clip_high: float = 2.0
    """Cap of the sequence-level importance weight, > 0. Default 2.0 (SkyRL: 5.0)."""


@dataclass
class AlgorithmConfig:
    """The RL objective."""

    advantage_estimator: str = "grpo"
    """`grpo` (default) or `rloo`."""
    eps_clip_low: float = 0.2
    """PPO ratio clip below 1, >= 0. Default 0.2."""
    eps_clip_high: float = 0.2
    """PPO ratio clip above 1, >= 0. Default 0.2."""
    use_kl_loss: bool = False
    """Add a KL-to-reference loss (needs a reference model). Default false."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss, >= 0. Default 0.001."""
    loss_reduction: str = "token_mean"
    """`token_mean` (default), `sequence_mean` or `seq_mean_token_sum_norm`."""
    grpo_norm_by_std: bool = True
    """Divide GRPO advantages by the group's reward std. Default true."""
    zero_variance_filter: bool = True
    """Leave groups whose rewards are all equal (no signal) out of the loss. Default true (SkyRL:
    false). `job.drop_zero_advantage_groups` is an alias of this key."""
    off_policy_correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)


@dataclass
class TrainerConfig:
    """The training loop and the policy workers."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    strategy: str = "fsdp"
    """`fsdp` (default) or `megatron`; SkyRL's `fsdp2` is read as `fsdp`."""
    train_batch_size: int = 8
    """Prompts per training step, >= 1. Default 8."""
    policy_mini_batch_size: int = 8
    """Prompts per optimizer step, >= 1, divides train_batch_size. Default 8."""
    micro_train_batch_size_per_gpu: int = 1
    """Sequences per forward/backward on one rank, >= 1. Default 1."""
    max_tokens_per_microbatch: int = -1
    """Cap on the padded tokens (rows x longest row) of one forward/backward, besides
    micro_train_batch_size_per_gpu rows; a longer row runs alone. -1 (default): no cap."""
    micro_batch_pass_tokens: float = 64.0
    """What one more forward/backward costs, in padded tokens, >= 0: a rank's rows of a mini-batch,
    sorted by length, are cut into micro-batches where padded tokens plus this per pass are fewest.
    64 (default) is about a pass's fixed cost on the small CPU models; .inf: the fewest passes."""
    correct_threshold: float = 1.0
    """A trajectory counts as correct (the `accuracy` metric) when its reward is at least this.
    Default 1.0."""
    update_epochs_per_batch: int = 1
    """Passes over each training batch, >= 1. Default 1."""
    epochs: int = 1
    """Passes over the dataset, >= 1. Default 1."""
    seed: int = 42
    """Seed for data order, sampling and initialisation, >= 0. Default 42."""
    ckpt_path: str | None = None
    """Directory for resumable checkpoints; none (default) disables checkpointing."""
    ckpt_interval: int = 10
    """Save a checkpoint every this many steps, >= 1. Default 10."""
    hf_save_interval: int = -1
    """Export the policy as a Hugging Face model (in the model's own dtype; LoRA: merged, plus the
    adapter) every this many steps and after the last one; -1 (default, SkyRL's): never."""
    export_path: str | None = None
    """Where the exports go (`<export_path>/global_step_<k>/`); null (default): <job.output_dir>/exports."""
    eval_interval: int = 5
    """Evaluate on the held-out sets every this many steps, >= 0; 0 turns evaluation off (also before
    and after training). Default 5 (SkyRL's). `job.eval_interval` is an alias of this key."""
    eval_before_train: bool = True
    """Evaluate before the first step (when eval_interval > 0). Default true."""
    eval_batch_size: int = 1024
    """Held-out prompts evaluated at once, >= 1 (the rest wait). Default 1024."""
    dump_eval_results: bool = True
    """Write each evaluation's samples.jsonl and metrics.json to <job.output_dir>/eval/step_<k>/.
    Default true."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (after the chat template), >= 1; longer ones are dropped and counted
    (or refused: data.drop_long_prompts=false). Default 512 (SkyRL's). Data tasks only."""
    bf16: bool | None = None
    """Train in bfloat16 over float32 master weights and optimizer state (autocast for the local
    worker, FSDP2's MixedPrecisionPolicy, Megatron's bf16). null (default): true on CUDA, false on
    CPU (where bfloat16 matmuls are slow without native support)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them. Default
    false (SkyRL's is true; on the small CPU models the recompute costs more than the memory saves)."""
    logprobs_chunk_size: int | None = 1024
    """Tokens per chunk of the training forward's log-probabilities, >= 1: the LM head and the
    log-softmax over the vocabulary run a chunk at a time under activation checkpointing, so the
    [tokens, vocabulary] float32 logits never exist at once (the same values and gradients; the LM
    head's matmul runs once more in the backward). null: the whole micro-batch at once. Default
    1024 (SkyRL's). The local worker (one policy rank); FSDP runs the full logits, megatron its
    vocab-parallel cross-entropy: neither chunks yet."""
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    """Experiment trackers: any of `console` (progress bar), `tensorboard`, `wandb`, `mlflow`; one
    name, a comma list or a list. Default console and tensorboard. The metrics JSONL is always written."""
    project_name: str = "inflight"
    """The tracker's project (W&B project, MLflow experiment). Default inflight."""
    run_name: str | None = None
    """The tracker's run name; null (default): the name of job.output_dir."""

    def __post_init__(self) -> None:
        self.strategy = canonical_strategy(self.strategy)


@dataclass
class InferenceEngineConfig:
    """The inference engines and how weights reach them."""

    backend: str = "native"
    """The inference engine: `native` (default; this project's paged-KV engine, in this process or
    in child processes) or `vllm` (vLLM, in its own virtual environment, behind `inflight serve
    --backend vllm`: the same HTTP routes, driven through `RemoteClient`; weights as safetensors chunks
    through the client, weight_sync_backend `shm` or `inprocess`). SkyRL's default is `vllm`; ours is `native` because
    vLLM is not a dependency of this project."""
    vllm_python: str | None = None
    """backend=vllm only: the python of vLLM's virtual environment. None (default): `$INFLIGHT_VLLM_PYTHON`,
    else the repository's `.venv-vllm/bin/python` (`scripts/vllm_venv.sh` creates it)."""
    run_engines_locally: bool = True
    """True (default): the run starts its engines (native: in process or as child processes;
    vllm: `inflight serve --backend vllm` servers on free 127.0.0.1 ports, logs in
    `<job.output_dir>/servers/`). False: the run drives servers started elsewhere, listed in
    external_server_urls (control token: `$INFLIGHT_CONTROL_TOKEN`); the engine settings are then
    the servers' own flags, and the run pushes its weights to them before the first rollout."""
    external_server_urls: list[str] | None = None
    """run_engines_locally=false only: the servers' base URLs (`http://host:port`), one per engine
    (num_engines must equal their number). None (default): none."""
    num_engines: int = 1
    """Number of engines, >= 1. Default 1."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per engine, >= 1. Default 1, the only one implemented: a run refuses
    more (use num_engines for more engines)."""
    weight_sync_backend: str = "broadcast"
    """Weight transport: `inprocess`, `shm` (one host) or `broadcast` (torch.distributed; default).
    SkyRL's `nccl` / `gloo` mean `broadcast`, `cuda_ipc` means `shm`. Into HTTP servers (backend=vllm,
    external_server_urls): `shm` hands them chunk files in /dev/shm (servers on this host), `inprocess`
    sends chunks in request bodies; `broadcast` is not implemented there."""
    weight_sync_host: str = "127.0.0.1"
    """Address the trainer's `shm` / `broadcast` sender listens on (the engines connect to it).
    Default 127.0.0.1 (one host)."""
    weight_sync_port: int = 0
    """Port of that sender, in [0, 65535]; 0 (default) picks a free one."""
    weight_sync_chunk_size_mb: float | None = None
    """Largest chunk a sync sends at once, in MiB, > 0 (the size of the shared / broadcast buffer);
    larger tensors go in pieces. None (default): the whole model when it is small, at most 256 MiB."""
    weight_sync_staged: bool = True
    """`shm` only: pack each update into shared memory before the sync pauses the engines, so the
    pause holds only their copy out of it (not a SkyRL key). Costs shared memory for a whole update
    (the trainer's dtype), made once; it grows only while 1 GiB of /dev/shm and of available memory
    stays free, and packs the rest during the pause. False: pack chunk by chunk during the pause."""
    offload_kv_for_weight_sync: bool = False
    """Non-colocated only: sleep the engine during a sync, freeing its memory; the KV of
    in-flight requests is copied to host and restored (unless cleared). The sleep drops the
    engine's weights, so a LoRA policy's sync sends its merged weights, not the adapter. Default
    false."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (keys include the weight version). Default true."""
    enable_chunked_prefill: bool = True
    """Split long prefills across steps. Default true."""
    block_size: int = 16
    """Tokens per KV block, >= 1. Default 16."""
    num_kv_blocks: int | None = None
    """KV blocks per engine, >= 1; none (default) derives it from kv_cache_memory_gib."""
    kv_cache_memory_gib: float = 1.0
    """KV memory per engine when num_kv_blocks is none, > 0. Default 1.0."""
    max_num_seqs: int = 64
    """Requests running at once per engine, >= 1. Default 64."""
    max_num_batched_tokens: int = 2048
    """Tokens per engine step, >= 1. Default 2048."""
    max_model_len: int | None = None
    """Longest prompt + generation; none (default) uses the model's max_position_embeddings."""
    dtype: str = "float32"
    """Engine weights and KV: `float32` (default), `bfloat16` or `float16` (SkyRL: `model_dtype`)."""
    device: str = "cpu"
    """Torch device of the engine: `cpu` (default), `cuda`, `cuda:N`."""
    attention_backend: str = "auto"
    """Decode attention: `native` (the C kernel over paged KV, CPU), `torch` (gather + SDPA, any
    device) or `auto` (default: native where it is supported and builds, else torch)."""
    linear_backend: str = "auto"
    """Linear layers: `onednn` (weights prepacked for oneDNN in their dtype, CPU), `onednn_fp32`
    (bfloat16 weights computed in float32), `torch` (F.linear) or `auto` (default: onednn where
    oneDNN runs the dtype, else onednn_fp32 for bfloat16, else torch)."""
    elementwise_backend: str = "auto"
    """RMSNorm, residual add, rotary and silu*mul: `native` (fused C kernels, CPU float32/bfloat16),
    `torch` or `auto` (default: native where supported and the kernels build, else torch)."""
    weight_update_rollback: bool = True
    """Keep the pre-update weights until an update finishes, so a failed one is rolled back (costs up
    to one extra copy of the weights during an update). Default true."""
    weight_update_timeout_s: float | None = 300.0
    """An engine abandons a weight update that receives nothing for this long (the old weights come
    back where rollback kept them), so a sender that died mid-update cannot freeze generation, > 0.
    null: no lease. Default 300."""

    def __post_init__(self) -> None:
        self.weight_sync_backend = canonical_weight_sync_backend(self.weight_sync_backend)


@dataclass
class SamplingConfig:
    """Sampling for rollouts (SkyRL: `generator.sampling_params`)."""

    temperature: float = 1.0
    """Softmax temperature, >= 0 (0 is greedy). Default 1.0."""
    top_p: float = 1.0
    """Nucleus mass, in (0, 1]. Default 1.0 (off)."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (default) or 0 turns it off."""
    max_generate_length: int = 1024
    """Most tokens generated per response, >= 1. Default 1024."""
    stop: list[str] | None = None
    """Stop strings; none (default) stops only at EOS. A turn ends at the first one in the decoded
    response; the tokens up to the one that completed it are kept (and trained on)."""
    include_stop_str_in_output: bool = False
    """Whether the text handed to the reward / environment keeps the stop string (vLLM's flag and
    default: false drops it). The trained tokens always include it."""


@dataclass
class GeneratorConfig:
    """Rollout generation."""

    inference_engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    sampling_params: SamplingConfig = field(default_factory=SamplingConfig)
    n_samples_per_prompt: int = 4
    """Responses per prompt (the GRPO group size), >= 1. Default 4."""
    eval_sampling_params: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling for evaluation (same fields and defaults as sampling_params; temperature 0 is greedy).
    A turn's tokens stay within the task's own cap (a built-in task's answer length, a data task's
    sampling_params.max_generate_length)."""
    eval_n_samples_per_prompt: int = 1
    """Responses per held-out prompt, >= 1; pass@k is reported for k = 1, 2, 4, ... up to it. Default 1."""
    max_turns: int = 1
    """Most model turns per episode, >= 1, for environments that leave it to the run (a ToolEnv, your
    own environment without a `max_turns`); an environment that sets its own `max_turns` (e.g.
    chain_addition's chain) keeps it. Default 1 (single-turn)."""
    skip_failed_rollouts: bool = True
    """An episode whose environment fails (building it, `reset()`, turning its observation into
    tokens) costs that sample, not the run: it scores 0 with what it generated so far (counted in
    `rollout/failed`), or, when it failed before its first turn, its group is dropped and recorded as
    `failed` in consumed.jsonl (never trained, never lost). false: the failure ends the run (SkyRL's
    default). Rewards that fail always score 0 (`environment.reward_timeout_s`). Default true."""


@dataclass
class DataConfig:
    """Your own data (SkyRL: `data`). Giving `train_data` trains on it instead of a built-in task."""

    train_data: list[str] = field(default_factory=list)
    """Training files: `.parquet`, `.jsonl` / `.json`, or `datasets.save_to_disk` directories; a single
    path is read as a list of one. Default [] (the built-in task; SkyRL: ~/data/gsm8k/train.parquet)."""
    val_data: list[str] = field(default_factory=list)
    """Held-out files, same formats. Default []: held-out problems are split off the training data
    (seeded by trainer.seed, data.val_fraction of it, at most job.num_eval) and never trained on."""
    val_fraction: float = 0.1
    """Share of the training rows split off as held-out when val_data is empty, in (0, 1). Default 0.1."""
    prompt_key: str | None = None
    """Column holding the prompt (text or chat messages); none (default): `prompt`, else `question`."""
    answer_key: str | None = None
    """Column holding the ground truth; none (default): `reward_spec.ground_truth` (SkyRL's rows), else
    `answer`. An answer with `####` (GSM8K's) has what follows the last `####` as its ground truth."""
    drop_long_prompts: bool = True
    """Drop prompts longer than trainer.max_prompt_length (counted and reported); false refuses the data
    with an error naming the first such row. Default true."""

    def __post_init__(self) -> None:
        self.train_data = [self.train_data] if isinstance(self.train_data, str) else self.train_data
        self.val_data = [self.val_data] if isinstance(self.val_data, str) else self.val_data


@dataclass
class EnvironmentConfig:
    """How responses to your data are scored (SkyRL: `environment`)."""

    env_class: str | None = None
    """The reward / environment of rows without their own `env_class` column (a row's own wins):
    `gsm8k`, `gsm8k_flexible`, `math`, `exact`, `contains`, `regex`, a name given to
    `inflight.rewards.register`, or `package.module:name` (your reward function or environment class).
    None (default; SkyRL: gsm8k): `gsm8k` for rows whose answer holds GSM8K's `####`, else `exact`.
    Built-in tasks (job.task) score themselves and refuse this key."""
    reward_timeout_s: float | None = 60.0
    """Most seconds one reward / environment step may take; a step that takes longer, or raises,
    scores its sample 0 and is counted (`reward/failures`), and training goes on. None: no limit.
    Default 60."""


@dataclass
class Config:
    """Everything a run needs. `Config()` is the default fully-async, non-colocated setup."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
