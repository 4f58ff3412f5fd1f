"""The models a run trains or reads: the policy, the reference and the critic, with their
optimizer, LoRA, FSDP and Megatron settings (SkyRL: `trainer.policy`, `trainer.ref`,
`trainer.critic`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.config.status import accepted, gpu_only, ours, refused, skyrl

_CPU_HOST = "on CPU the state already lives in host memory"
MIXED_PRECISION_DTYPES = ("bf16", "fp16", "fp32")
"""The values of `fsdp_config.mixed_precision.*` (FSDP2's MixedPrecisionPolicy dtypes, SkyRL's spellings)."""


@dataclass
class LoraConfig:
    """LoRA adapters (`peft`): only the adapters train, and each weight sync sends the adapter,
    which the engines merge into their base weights."""

    rank: int = skyrl(0)
    """Rank of the adapters; 0 (default) disables LoRA."""
    alpha: int = skyrl(16)
    """LoRA scaling alpha (the update is scaled by alpha / rank). Default 16."""
    dropout: float = skyrl(0.0)
    """Dropout on the adapters' input during training, in [0, 1). Default 0."""
    lora_sync_path: str = skyrl("/tmp/skyrl_lora_sync", status=accepted(
        "adapters reach the engines as weight updates through the weight-sync transport, never as files"))
    """Where SkyRL writes adapters for vLLM to load. Default /tmp/skyrl_lora_sync."""
    target_modules: list[str] = skyrl(factory=lambda: ["all-linear"])
    """Modules that get adapters: `all-linear` (default: every linear layer but the LM head) or module
    names (`q_proj,v_proj`)."""
    exclude_modules: list[str] | None = skyrl(None)
    """Module names left without adapters (peft's `exclude_modules`); null (default): none."""
    init_method: str = skyrl("kaiming", choices=("kaiming", "gaussian"))
    """Initialisation of the adapters (peft's `init_lora_weights`): `kaiming` (default: A
    Kaiming-uniform, B zero) or `gaussian` (A normal, B zero). (peft's data- or SVD-based ones
    change the base weights, which the engines, merging the adapter into the base they hold, would
    not see: they are refused.)"""
    max_loras: int = skyrl(1, status=refused(
        "one adapter at a time: the engines merge the policy's adapter into their weights (no multi-LoRA "
        "serving)", fix="set max_loras=1"))
    """Adapters active at once in the engines (vLLM's max_loras). Default 1."""
    max_cpu_loras: int | None = skyrl(None, status=refused(
        "one adapter at a time: the engines merge the policy's adapter into their weights (no LoRA cache)",
        fix="leave max_cpu_loras=null"))
    """vLLM's CPU cache of adapters. Default null."""


_QAT = refused("fake-INT4 quantisation-aware training (Megatron, INT4-served MoE experts) is not implemented",
               runs=lambda v: v is False)
_QAT_PART = accepted("read only with fake_int4_qat.enabled=true, which is refused")


@dataclass
class FakeInt4QatConfig:
    """SkyRL's fake-INT4 quantisation-aware training of MoE experts (Megatron): not implemented."""

    enabled: bool = skyrl(False, status=_QAT)
    """Fake-quantise the expert GEMMs to the served INT4 grid. Default false (true is refused)."""
    group_size: int = skyrl(32, status=_QAT_PART)
    symmetric: bool = skyrl(True, status=_QAT_PART)
    scale_divisor: float = skyrl(7.5, status=_QAT_PART)
    q_min: float = skyrl(-8.0, status=_QAT_PART)
    bf16_base_path: str | None = skyrl(None, status=_QAT_PART)


@dataclass
class ModelConfig:
    """A model: its checkpoint, LoRA adapters."""

    path: str | None = skyrl(None)
    """Local Hugging Face checkpoint directory (or hub id, where the hub is reachable). Default none."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    fake_int4_qat: FakeInt4QatConfig = field(default_factory=FakeInt4QatConfig)


@dataclass
class PolicyModelConfig(ModelConfig):
    """The trained policy's model: its checkpoint, LoRA adapters, and what of a vision-language
    model trains."""

    freeze_vision_tower: bool = ours(True)
    """A vision-language policy's vision tower (its image encoder and the merger into the language
    model, transformers' `visual`) gets no gradient and no optimizer state; LoRA adapts only the
    language model. false: full fine-tuning trains it too (full-weight syncs always carry it);
    refused with LoRA. verl's name (`actor.freeze_vision_tower`); SkyRL has no such key. Unused by a
    text-only model. Default true."""


@dataclass
class OptimizerConfig:
    """AdamW settings."""

    lr: float = skyrl(1e-6)
    """Learning rate, > 0. Default 1e-6."""
    adam_betas: list[float] = skyrl(factory=lambda: [0.9, 0.999])
    """AdamW betas, two values in [0, 1). Default [0.9, 0.999]."""
    weight_decay: float = skyrl(1e-2)
    """AdamW weight decay, >= 0. Default 0.01."""
    max_grad_norm: float = skyrl(1.0)
    """Gradient clipping norm, > 0. Default 1.0."""
    offload_after_step: bool = skyrl(True)
    """Colocated runs (`colocate_all`) on CUDA: move the AdamW state to host memory after each
    optimizer step and back before the next, so the engines get the device memory while they
    generate. Default true. On CPU the state already is in host memory."""
    num_warmup_steps: int = skyrl(0)
    """Optimizer steps of linear warm-up from 0 to `lr`, >= 0. Default 0."""
    scheduler: str = skyrl("constant_with_warmup",
                           choices=("constant", "constant_with_warmup", "linear", "cosine"))
    """Learning-rate schedule over the optimizer steps (transformers' `get_scheduler`): `constant`,
    `constant_with_warmup` (default), `linear` or `cosine` (these two decay to 0 at the run's
    last optimizer step)."""


@dataclass
class MixedPrecisionConfig:
    """FSDP2's mixed precision when `trainer.bf16` is on (the local worker: the autocast dtype)."""

    param_dtype: str = skyrl("bf16", choices=MIXED_PRECISION_DTYPES)
    """Dtype of the compute (all-gathered parameters; the local worker's autocast): `bf16`
    (default), `fp16` or `fp32`."""
    reduce_dtype: str = skyrl("fp32", choices=MIXED_PRECISION_DTYPES)
    """Dtype gradients are reduced in: `fp32` (default) or `bf16`."""
    buffer_dtype: str = skyrl(
        "fp32",
        choices=MIXED_PRECISION_DTYPES,
        status=refused(
            "buffers (rotary tables) stay in float32: FSDP2's mixed precision does not cast them",
            runs=lambda v: v == "fp32",
        ),
    )


@dataclass
class FSDPConfig:
    """FSDP2 settings (`trainer.strategy=fsdp`)."""

    cpu_offload: bool = skyrl(False)
    """Keep parameters, gradients and optimizer state in host memory between uses (FSDP2's
    `CPUOffloadPolicy` on CUDA). Default false. On CPU they already are."""
    reshard_after_forward: bool | int = skyrl(True)
    """Free each layer's gathered parameters after its forward (FSDP2's `reshard_after_forward`):
    true (default), false, or an int (reshard to that many ranks)."""
    fsdp_size: int = skyrl(-1)
    """Ranks one copy is sharded over: -1 (default, or the ranks' count or more) all of them; a divisor
    S of the ranks shards each of ranks / S replicas over S ranks (hybrid sharding, FSDP2 on a 2-D
    device mesh: gradients reduce-scattered in a replica, all-reduced across them)."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    wrap_policy: dict[str, Any] = skyrl(factory=dict)
    """`{transformer_layer_cls_to_wrap: [class names]}`: the modules sharded as one unit each. Empty
    (default): each decoder layer, then the whole model."""


@dataclass
class DDPConfig:
    """Megatron's data-parallel gradient settings."""

    grad_reduce_in_fp32: bool = skyrl(True, status=refused(
        "gradients are always reduced in float32", runs=lambda v: v is True))
    overlap_grad_reduce: bool = skyrl(False, status=refused(
        "overlapping the gradient reduction with the backward is not implemented", runs=lambda v: v is False))
    overlap_param_gather: bool = skyrl(False, status=refused(
        "overlapping the parameter gather with the forward is not implemented", runs=lambda v: v is False))
    average_in_collective: bool = skyrl(True, status=refused(
        "gradients are always averaged over the data-parallel ranks", runs=lambda v: v is True))


@dataclass
class HFExportConfig:
    """How a Megatron policy is exported as a Hugging Face checkpoint."""

    distributed_save: bool = skyrl(
        False,
        status=refused(
            "exports are written by rank 0 (the models this project trains fit one writer)",
            runs=lambda v: v is False,
        ),
    )
    save_every_n_ranks: int = skyrl(
        1, status=accepted("read only with distributed_save=true, which is refused")
    )


@dataclass
class MegatronLoraConfig:
    """LoRA under Megatron (`trainer.policy.model.lora.rank` > 0 with trainer.strategy=megatron)."""

    lora_type: str = skyrl(
        "lora",
        status=refused(
            "canonical_lora (separate q/k/v and gate/up adapters) is not implemented; lora (one adapter per "
            "fused megatron layer, SkyRL's default) is"
        ),
    )
    """`lora`: one adapter per megatron layer (linear_qkv, linear_proj, linear_fc1, linear_fc2), so q/k/v
    (and gate/up) share their A. Default lora."""
    merge_lora: bool = skyrl(True)
    """What a weight sync sends: the weights with the adapter merged (true, default), or the adapter
    alone (false), which the native engines merge themselves (vLLM's servers take merged weights
    either way)."""


_MEGATRON_OPTIMIZER_KWARGS = {
    "overlap_cpu_optimizer_d2h_h2d": False,
    "use_precision_aware_optimizer": False,
    "optimizer_cpu_offload": False,
    "optimizer_offload_fraction": 0.0,
}
_MEGATRON_TRANSFORMER_KWARGS = {
    "recompute_granularity": "full",
    "recompute_modules": ["core_attn"],
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    "gradient_accumulation_fusion": False,
}
_MTP_PART = accepted("read only with multi-token-prediction heads, which are refused")


@dataclass
class MegatronConfig:
    """The Megatron backend (`trainer.strategy=megatron`) and the MoE routing switches."""

    tensor_model_parallel_size: int = skyrl(1)
    """Ranks each layer is split over, >= 1; must divide the policy's ranks (the rest is data
    parallelism) and the model's attention and KV heads. Default 1."""
    pipeline_model_parallel_size: int = skyrl(1, status=gpu_only("pipeline parallelism"))
    context_parallel_size: int = skyrl(1, status=gpu_only("context parallelism"))
    expert_model_parallel_size: int = skyrl(1, status=gpu_only("expert parallelism"))
    expert_tensor_parallel_size: int | None = skyrl(None, status=refused(
        "expert tensor parallelism is not implemented", runs=lambda v: v in (None, 1)))
    moe_token_dispatcher_type: str = skyrl("alltoall", status=accepted(
        "with one expert-parallel rank every token's experts are on its own rank: nothing is dispatched"))
    moe_router_load_balancing_type: str = skyrl("none", status=refused(
        "an auxiliary load-balancing loss is not implemented yet", runs=lambda v: v == "none"))
    moe_aux_loss_coeff: float = skyrl(0.0, status=refused(
        "an auxiliary load-balancing loss is not implemented yet", runs=lambda v: v == 0))
    moe_grouped_gemm: bool = skyrl(True, status=accepted(
        "the experts run one matmul per expert over the tokens routed to it, whatever this says"))
    moe_router_score_function: str | None = skyrl(None, status=refused(
        "the router's score function is the model's own (its Hugging Face config)", runs=lambda v: v is None))
    moe_router_enable_expert_bias: bool | None = skyrl(None, status=refused(
        "the router's expert bias is the model's own (its Hugging Face config)", runs=lambda v: v is None))
    moe_enable_routing_replay: bool = skyrl(False)
    """Routing replay ("R3") for a mixture-of-experts model: the training forward (and, for
    `trainer.ref`, the reference's; the critic never replays) uses the experts the rollout's engine
    chose for each token instead of its own router's choice, gated by the current router over those
    experts. The key sits in `megatron_config` because that is where SkyRL has it, but it acts on
    every worker kind, whatever `trainer.strategy` (local and FSDP; the Megatron worker takes dense
    models only). Needs `generator.inference_engine.enable_return_routed_experts=true` (the rollouts'
    routing record, which alone already gives the `moe/*` metrics and the dumped record). Default
    false."""
    moe_per_layer_logging: bool = skyrl(False, status=refused(
        "per-layer MoE metrics are not implemented yet", runs=lambda v: v is False))
    moe_router_dtype: str = skyrl("fp32", choices=("fp32", "fp64"), status=refused(
        "the router's softmax runs in float32, as transformers computes it", runs=lambda v: v == "fp32"))
    ddp_config: DDPConfig = field(default_factory=DDPConfig)
    hf_export_config: HFExportConfig = field(default_factory=HFExportConfig)
    lora_config: MegatronLoraConfig = field(default_factory=MegatronLoraConfig)
    optimizer_config_kwargs: dict[str, Any] = skyrl(
        factory=lambda: dict(_MEGATRON_OPTIMIZER_KWARGS),
        status=accepted(
            "SkyRL's four keys (optimizer_cpu_offload, optimizer_offload_fraction, "
            "overlap_cpu_optimizer_d2h_h2d, "
            "use_precision_aware_optimizer) move optimizer state between GPU and host: " + _CPU_HOST
        ),
    )
    """Megatron optimizer pass-through. Default SkyRL's four offload keys, all off."""
    transformer_config_kwargs: dict[str, Any] = skyrl(factory=lambda: dict(_MEGATRON_TRANSFORMER_KWARGS))
    """Fields of Megatron's TransformerConfig set on the policy's model (recompute_granularity, ...);
    an unknown field is an error naming it. Default SkyRL's recompute settings."""
    empty_cuda_cache: bool | None = skyrl(
        True, status=accepted("CUDA's allocator cache; nothing to empty on CPU")
    )
    model_config_kwargs: dict[str, Any] = skyrl(factory=dict)
    """Fields of the Hugging Face config overridden before the Megatron model is built from it. Default {}."""
    dist_ckpt_optim_fully_reshardable: bool = skyrl(
        False,
        status=refused(
            "checkpoints are one Hugging Face model plus the optimizer state (no Megatron distributed "
            "checkpoint)",
            runs=lambda v: v is False,
        ),
    )
    freeze_moe_router: bool = skyrl(False)
    """Keep the policy's MoE routers' parameters frozen (no gradient, not in the optimizer; no-op on
    dense models). Default false."""
    mtp_num_layers: int | None = skyrl(None, status=refused(
        "multi-token-prediction heads are not implemented", runs=lambda v: v in (None, 0)))
    mtp_loss_weight: float = skyrl(0.1, status=_MTP_PART)
    mtp_loss_chunk_size: int | None = skyrl(1024, status=_MTP_PART)
    mtp_loss_topk: int | None = skyrl(None, status=_MTP_PART)
    async_dist_ckpt_save: bool = skyrl(False, status=refused(
        "asynchronous distributed checkpoints are not implemented", runs=lambda v: v is False))
    async_dist_ckpt_strategy: str = skyrl("mcore", status=accepted(
        "read only with async_dist_ckpt_save=true, which is refused"))
    async_save_prestage_to_cpu: bool = skyrl(False, status=refused(
        "asynchronous distributed checkpoints are not implemented", runs=lambda v: v is False))


_PROFILER_PART = accepted("read only with torch_profiler_config.enable=true, which is refused")


@dataclass
class TorchProfilerConfig:
    """torch.profiler around policy training steps (not implemented yet: enable is refused)."""

    enable: bool = skyrl(False, status=refused("profiling training steps is not implemented yet",
                                               runs=lambda v: v is False))
    ranks: list[int] = skyrl(factory=lambda: [0], status=_PROFILER_PART)
    save_path: str | None = skyrl(None, status=_PROFILER_PART)
    skip_first: int = skyrl(10, status=_PROFILER_PART)
    wait: int = skyrl(0, status=_PROFILER_PART)
    warmup: int = skyrl(1, status=_PROFILER_PART)
    active: int = skyrl(1, status=_PROFILER_PART)
    repeat: int = skyrl(1, status=_PROFILER_PART)
    activities: list[str] = skyrl(factory=lambda: ["cpu", "cuda"], status=_PROFILER_PART)
    record_shapes: bool = skyrl(True, status=_PROFILER_PART)
    profile_memory: bool = skyrl(False, status=_PROFILER_PART)
    with_stack: bool = skyrl(True, status=_PROFILER_PART)
    with_flops: bool = skyrl(False, status=_PROFILER_PART)
    with_modules: bool = skyrl(False, status=_PROFILER_PART)
    export_type: str = skyrl("chrome_trace", status=_PROFILER_PART)


_LANGUAGE_ONLY = accepted(
    "every model this project loads is a language model: there is no vision encoder to skip"
)
_NO_SEQ_PARALLEL = gpu_only("sequence parallelism")


@dataclass
class PolicyConfig:
    """The trained policy."""

    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    sequence_parallel_size: int = skyrl(1, status=_NO_SEQ_PARALLEL)
    use_torch_compile: bool = skyrl(False, status=refused("torch.compile of the log-probabilities is not "
                                                          "implemented", runs=lambda v: v is False))
    record_memory: bool = skyrl(False, status=refused("CUDA memory snapshots are not implemented",
                                                      runs=lambda v: v is False))
    torch_profiler_config: TorchProfilerConfig = field(default_factory=TorchProfilerConfig)
    megatron_config: MegatronConfig = field(default_factory=MegatronConfig)
    model_config_kwargs: dict[str, Any] = skyrl(factory=dict)
    """Fields of the model's Hugging Face config overridden when the trainer loads it (e.g.
    `{attention_dropout: 0.0}`). Default {}."""
    language_model_only: bool = skyrl(False, status=_LANGUAGE_ONLY)
    inference_only_init: bool = skyrl(False, status=refused(
        "an inference-only policy worker is not implemented (every run trains)", runs=lambda v: v is False))


@dataclass
class RefConfig:
    """The reference model of the KL terms (SkyRL: `trainer.ref`): a frozen copy in the policy's
    process, forwarded without gradients."""

    model: ModelConfig = field(default_factory=ModelConfig)
    sequence_parallel_size: int = skyrl(1, status=_NO_SEQ_PARALLEL)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    megatron_config: MegatronConfig = field(default_factory=MegatronConfig)
    model_config_kwargs: dict[str, Any] = skyrl(factory=dict)
    """Fields of the reference's Hugging Face config overridden when it is loaded. Default {}."""
    language_model_only: bool = skyrl(False, status=_LANGUAGE_ONLY)


@dataclass
class CriticConfig:
    """The value model of `advantage_estimator=gae` (SkyRL: `trainer.critic`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    sequence_parallel_size: int = skyrl(1, status=_NO_SEQ_PARALLEL)
    model_config_kwargs: dict[str, Any] = skyrl(factory=dict)
    """Fields of the critic's Hugging Face config overridden when it is loaded. Default {}."""


__all__ = [
    "CriticConfig", "DDPConfig", "FSDPConfig", "FakeInt4QatConfig", "HFExportConfig", "LoraConfig",
    "MegatronConfig", "MegatronLoraConfig", "MixedPrecisionConfig", "ModelConfig", "OptimizerConfig",
    "PolicyConfig", "PolicyModelConfig", "RefConfig",
    "TorchProfilerConfig",
]
