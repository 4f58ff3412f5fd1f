"""validate(cfg): every type error, out-of-range value and contradictory combination, at once.

Each rule names the keys it reads; a rule is skipped when one of its keys already has a type error,
so a wrong type is reported once and not again as a puzzling range or combination error.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from inflight.algorithms.registry import policy_loss_traits  # what each loss registered; no torch
from inflight.backends.registry import entries_with_setting
from inflight.config.errors import ConfigError, Violation
from inflight.config.keys import get_key, is_instance, schema_choices, schema_keys, type_name
from inflight.config.schema import Config
from inflight.config.schema.generator import weight_transport

Rule = Callable[[Config], Iterator[Violation]]
_RULES: list[tuple[frozenset[str], Rule]] = []

COLOCATE = "trainer.placement.colocate_all"
FULLY_ASYNC = "trainer.fully_async.enabled"
CLEAR_KV = "trainer.fully_async.clear_kv_cache_on_weight_sync"
OFFLOAD_KV = "generator.inference_engine.offload_kv_for_weight_sync"
PREFIX_CACHING = "generator.inference_engine.enable_prefix_caching"
LORA_RANK = "trainer.policy.model.lora.rank"
MEGATRON_TP = "trainer.policy.megatron_config.tensor_model_parallel_size"
POLICY_NODES = "trainer.placement.policy_num_nodes"
POLICY_GPUS = "trainer.placement.policy_num_gpus_per_node"
SYNC_KEYS = (COLOCATE, FULLY_ASYNC, CLEAR_KV, OFFLOAD_KV, PREFIX_CACHING, LORA_RANK)
"""The keys `plan_weight_sync` reads; `validate_sync` checks exactly these and their rules."""

_DEVICE = re.compile(r"^(cpu|cuda|mps)(:\d+)?$")


def validate(cfg: Config) -> None:
    """Raise one `ConfigError` listing every violation in `cfg`; return None when it is valid."""
    violations = collect_violations(cfg)
    if violations:
        raise ConfigError(violations)


def validate_sync(cfg: Config) -> None:
    """Like `validate`, restricted to the keys the weight-sync plan reads (`SYNC_KEYS`)."""
    violations = collect_violations(cfg, only=frozenset(SYNC_KEYS))
    if violations:
        raise ConfigError(violations)


def collect_violations(cfg: Config, only: frozenset[str] | None = None) -> list[Violation]:
    """Every violation in `cfg` (types first, then rules); `only` restricts to rules on those keys."""
    leaves, _ = schema_keys()
    out = [_type_violation(k, get_key(cfg, k), tp) for k, tp in leaves.items() if only is None or k in only]
    out = [v for v in out if v is not None]
    bad = {v.key for v in out}
    for keys, rule in _RULES:
        if (only is None or keys <= only) and not keys & bad:
            out.extend(rule(cfg))
    return out


def _type_violation(key: str, value: Any, tp: Any) -> Violation | None:
    if is_instance(value, tp):
        return None
    default = get_key(Config(), key)
    example = default if isinstance(default, str) else json.dumps(default)
    got = f"{type(value).__name__} {value!r}"
    return Violation(key, value, f"expected {type_name(tp)}, got {got}", f"write e.g. {key}={example}")


def _rule(*keys: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        _RULES.append((frozenset(keys), fn))
        return fn

    return register


def _range_rule(key: str, ok: Callable[[Any], bool], rule: str, fix: str) -> None:
    def check(cfg: Config) -> Iterator[Violation]:
        value = get_key(cfg, key)
        if not ok(value):
            yield Violation(key, value, rule, fix)

    _rule(key)(check)


_IE = "generator.inference_engine."
_OPC = "trainer.algorithm.off_policy_correction."
_RANGES: list[tuple[tuple[str, ...], Callable[[Any], bool], str, str]] = [
    (
        (
            "trainer.train_batch_size", "trainer.policy_mini_batch_size",
            "trainer.micro_train_batch_size_per_gpu", "trainer.update_epochs_per_batch", "trainer.epochs",
            "trainer.critic_mini_batch_size",
            "trainer.micro_forward_batch_size_per_gpu", "trainer.algorithm.kl_ctrl.horizon",
            "environment.skyrl_gym.max_env_workers",
            "trainer.fully_async.num_parallel_generation_workers", "generator.n_samples_per_prompt",
            _IE + "num_engines", _IE + "tensor_parallel_size", _IE + "block_size", _IE + "max_num_seqs",
            _IE + "max_num_batched_tokens", "generator.sampling_params.max_generate_length",
            MEGATRON_TP, POLICY_NODES, POLICY_GPUS, "trainer.eval_batch_size",
            "generator.eval_n_samples_per_prompt", "generator.eval_sampling_params.max_generate_length",
            "generator.max_turns",
        ),
        lambda v: v >= 1, "must be >= 1", "set {key} to a positive integer",
    ),
    (
        ("trainer.fully_async.max_staleness_steps", "trainer.fully_async.engine_restarts", LORA_RANK,
         "trainer.seed", "trainer.policy.model.lora.alpha",
         "trainer.policy.optimizer_config.num_warmup_steps",
         "trainer.critic.optimizer_config.num_warmup_steps", "trainer.algorithm.value_clip",
         "trainer.algorithm.zero_variance_filter_tol"),
        lambda v: v >= 0, "must be >= 0", "set {key} to 0 or more",
    ),
    (
        (_IE + "num_kv_blocks", _IE + "max_model_len", "trainer.max_training_steps",
         "trainer.algorithm.max_seq_len", "generator.max_input_length",
         "trainer.algorithm.overlong_buffer_len", "generator.rate_limit.max_concurrency"),
        lambda v: v is None or v >= 1, "must be >= 1 or null", "set {key}=null, or a positive number",
    ),
    (
        ("trainer.policy.optimizer_config.lr", "trainer.policy.optimizer_config.max_grad_norm",
         "trainer.critic.optimizer_config.lr", "trainer.critic.optimizer_config.max_grad_norm",
         _IE + "weight_transfer_threshold_cuda_ipc_GB", "trainer.algorithm.kl_ctrl.kl_target"),
        lambda v: v > 0, "must be > 0", "set {key} to a positive number",
    ),
    ((_IE + "kv_cache_memory_gib", "generator.rate_limit.trajectories_per_second"),
     lambda v: v is None or v > 0, "must be > 0 or null",
     "set {key}=null to size it another way, or a positive number"),
    ((_IE + "gpu_memory_utilization",), lambda v: 0 < v <= 1, "must be in (0, 1]", "e.g. {key}=0.8"),
    (("trainer.algorithm.lambd", "trainer.algorithm.gamma",
      "trainer.algorithm.dynamic_sampling.min_replace_ratio"),
     lambda v: 0 <= v <= 1, "must be in [0, 1]", "e.g. {key}=1.0"),
    (("trainer.algorithm.clip_ratio_c",), lambda v: v > 1, "must be > 1 (the dual-clip bound lies beyond the "
     "clipped ratio)", "e.g. {key}=3.0"),
    (("trainer.eval_interval",), lambda v: v >= -1, "must be >= -1 (-1 or 0: no evaluation)",
     "set {key}=-1 to turn evaluation off, or a number of steps"),
    (("trainer.max_ckpts_to_keep",), lambda v: v != 0, "must be -1 (keep all) or >= 1 (keep the newest N)",
     "set {key}=-1, or the number of checkpoints to keep"),
    (("trainer.algorithm.dynamic_sampling.max_sample_batches",), lambda v: v == -1 or v >= 1,
     "must be -1 (no limit) or >= 1", "e.g. {key}=30"),
    (("trainer.algorithm.dynamic_sampling.type",), lambda v: v in (None, "filter", "replace"),
     "must be filter, replace or null", "use {key}=filter, {key}=replace, or {key}=null for none"),
    ((_OPC + "sequence_mask_metric",), lambda v: v in (None, "geometric", "product"),
     "must be geometric, product or null", "use {key}=geometric, {key}=product, or {key}=null for no mask"),
    (("trainer.resume_mode",), lambda v: v in (None, "none", "latest", "from_path"),
     "must be latest, from_path, or null / none", "use {key}=latest, {key}=from_path, or {key}=null"),
    (
        (_IE + "weight_sync_chunk_size_mb",),
        lambda v: v is None or v > 0, "must be > 0 or null", "set {key}=null to size it from the model",
    ),
    ((_IE + "weight_sync_port", "generator.agent.port"), lambda v: 0 <= v <= 65535, "must be in [0, 65535]",
     "use 0 for a free port"),
    ((_IE + "weight_sync_host", "generator.agent.host"), lambda v: bool(v.strip()), "must not be empty",
     "write e.g. {key}=127.0.0.1"),
    (("generator.agent.timeout_s",), lambda v: v is None or v > 0, "must be > 0 or null",
     "give the seconds an episode may take, e.g. {key}=600, or {key}=null for no limit"),
    (
        ("trainer.policy.optimizer_config.weight_decay", "trainer.algorithm.eps_clip_low",
         "trainer.algorithm.eps_clip_high", "trainer.algorithm.kl_loss_coef",
         "generator.sampling_params.temperature", "trainer.critic.optimizer_config.weight_decay",
         "generator.eval_sampling_params.temperature"),
        lambda v: v >= 0, "must be >= 0", "set {key} to 0 or more",
    ),
    (("generator.sampling_params.top_p", "generator.eval_sampling_params.top_p"),
     lambda v: 0 < v <= 1, "must be in (0, 1]", "use 1.0 to disable it"),
    (("generator.sampling_params.top_k", "generator.eval_sampling_params.top_k"),
     lambda v: v >= -1, "must be >= -1", "use -1 (or 0) to disable it"),
    (("trainer.policy.model.lora.dropout", "trainer.critic.model.lora.dropout"), lambda v: 0 <= v < 1,
     "must be in [0, 1)", "use 0.0 for none"),
    ((_OPC + "token_tis_ratio_clip_high", _OPC + "sequence_tis_ratio_clip_high"),
     lambda v: v > 0, "must be > 0", "set {key} to a positive number, e.g. {key}=2.0"),
    (("trainer.critic.optimizer_config.adam_betas",), lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
     "must be two values in [0, 1)", "write e.g. {key}=[0.9,0.999]"),
    ((_OPC + "tis_ratio_type",), lambda v: v in (None, "none", "token", "sequence"),
     "must be token, sequence or null", "use {key}=token, {key}=sequence, or {key}=null for no correction"),
    (("trainer.max_tokens_per_microbatch",), lambda v: v == -1 or v >= 1, "must be -1 or >= 1",
     "set {key}=-1 for no cap"),
    (("trainer.logprobs_chunk_size",), lambda v: v is None or v >= 1, "must be >= 1 or null",
     "set {key}=1024 (tokens per chunk), or {key}=null for no chunking"),
    (("trainer.micro_batch_pass_tokens",), lambda v: v >= 0, "must be >= 0",
     "set {key} to 0 or more, e.g. 64"),
    (("trainer.moe_logprob_gap_interval",), lambda v: v >= 0, "must be >= 0",
     "set {key}=0 for never, e.g. 10"),

    (("trainer.seed",), lambda v: v < 2**63, "must be below 2**63 (a 64-bit seed)",
     "use a smaller seed, e.g. 42"),
    ((_IE + "weight_update_timeout_s",), lambda v: v is None or v > 0, "must be > 0 or null",
     "give the seconds an update may go without a chunk, e.g. {key}=300, or {key}=null for no lease"),
    (("environment.reward_timeout_s",), lambda v: v is None or v > 0, "must be > 0 or null",
     "give the seconds a reward may take, e.g. {key}=60, or {key}=null for no limit"),
    (
        ("trainer.policy.optimizer_config.adam_betas",),
        lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
        "must be two values in [0, 1)", "write e.g. {key}=[0.9,0.999]",
    ),
    (
        (_IE + "device",),
        lambda v: bool(_DEVICE.match(v)),
        "must be a torch device: cpu, cuda, cuda:N or mps", "write e.g. {key}=cuda:0",
    ),
]  # fmt: skip
"""(keys, ok(value), rule, fix) for single-key range rules; `{key}` in the fix is the key."""
for _keys, _ok, _text, _fix in _RANGES:
    for _key in _keys:
        _range_rule(_key, _ok, _text, _fix.format(key=_key))


TRACKERS = ("console", "tensorboard", "wandb", "mlflow")
"""What `trainer.logger` may name (`inflight.tracking.trackers` builds them)."""


@_rule("trainer.logger")
def _trackers(cfg: Config) -> Iterator[Violation]:
    unknown = [name for name in cfg.trainer.logger if name not in TRACKERS]
    if unknown:
        yield Violation("trainer.logger", cfg.trainer.logger, f"unknown tracker(s) {unknown}",
                        f"use any of {list(TRACKERS)}, e.g. trainer.logger=console,wandb")


def _choice_rule(key: str, allowed: tuple[str, ...], aliases: dict[str, str]) -> None:
    def check(cfg: Config) -> Iterator[Violation]:
        value = get_key(cfg, key)
        if value not in allowed and value not in aliases:
            close = difflib.get_close_matches(value, list(allowed) + list(aliases), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            yield Violation(
                key, value, f"must be one of {', '.join(allowed)}", f"{hint}use one of {list(allowed)}"
            )

    _rule(key)(check)


for _key, (_allowed, _aliases) in schema_choices().items():  # declared on each field (`choices=`)
    _choice_rule(_key, _allowed, _aliases)


@_rule(COLOCATE, FULLY_ASYNC)
def _colocate_excludes_fully_async(cfg: Config) -> Iterator[Violation]:
    if cfg.trainer.placement.colocate_all and cfg.trainer.fully_async.enabled:
        yield Violation(
            COLOCATE, True,
            f"colocated engines sleep while the trainer trains, so they exclude {FULLY_ASYNC}=true",
            f"set {COLOCATE}=false for fully-async training, or {FULLY_ASYNC}=false for a synchronous "
            "trainer",
        )  # fmt: skip


@_rule(OFFLOAD_KV, COLOCATE)
def _offload_needs_non_colocated(cfg: Config) -> Iterator[Violation]:
    if cfg.generator.inference_engine.offload_kv_for_weight_sync and cfg.trainer.placement.colocate_all:
        yield Violation(
            OFFLOAD_KV, True,
            f"is for non-colocated engines only ({COLOCATE}=true already sleeps and wakes them around each "
            "sync)",
            f"set {OFFLOAD_KV}=false, or {COLOCATE}=false",
        )  # fmt: skip


_ALG = "trainer.algorithm."


@_rule(_ALG + "use_kl_loss", _ALG + "use_kl_in_reward")
def _kl_once(cfg: Config) -> Iterator[Violation]:
    if cfg.trainer.algorithm.use_kl_loss and cfg.trainer.algorithm.use_kl_in_reward:
        yield Violation(
            _ALG + "use_kl_in_reward",
            True,
            f"excludes {_ALG}use_kl_loss=true (the KL is either a loss term or a reward term)",
            f"set {_ALG}use_kl_loss=false (SkyRL's default is true)",
        )


@_rule(_ALG + "advantage_estimator", "trainer.critic.model.path")
def _gae_needs_critic(cfg: Config) -> Iterator[Violation]:
    if cfg.trainer.algorithm.advantage_estimator == "gae" and not cfg.trainer.critic.model.path:
        yield Violation(
            "trainer.critic.model.path",
            None,
            "is required by advantage_estimator=gae (the critic gives the values)",
            "set trainer.critic.model.path (e.g. the policy's model path)",
        )


@_rule(_ALG + "loss_reduction", _ALG + "max_seq_len")
def _token_sum_norm_needs_max_seq_len(cfg: Config) -> Iterator[Violation]:
    alg = cfg.trainer.algorithm
    if alg.loss_reduction == "seq_mean_token_sum_norm" and alg.max_seq_len is None:
        yield Violation(
            _ALG + "max_seq_len",
            None,
            "must be set with loss_reduction=seq_mean_token_sum_norm (it divides each sequence's token sum)",
            f"set {_ALG}max_seq_len, e.g. to the engines' "
            "max_model_len or max_prompt_length + max_generate_length",
        )


_REGISTRY_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _registry_name_rule(key: str) -> None:
    def check(cfg: Config) -> Iterator[Violation]:
        name = get_key(cfg, key)
        if not name.strip():
            yield Violation(
                key, name, "is empty", f"name a built-in one, e.g. {key}={get_key(Config(), key)}"
            )
        elif ":" in name and not _REGISTRY_NAME.match(name):
            yield Violation(key, name, "is not of the form package.module:name",
                            f"write e.g. {key}=my_package.my_module:my_function")

    _rule(key)(check)


for _key in (_ALG + "advantage_estimator", _ALG + "policy_loss_type"):
    _registry_name_rule(_key)  # a plain name may be registered by the user's code: a run checks it


_OPC_KEYS = tuple(
    _OPC + k
    for k in (
        "tis_ratio_type",
        "sequence_mask_metric",
        "outlier_token_is_threshold_low",
        "outlier_token_is_threshold_high",
        "token_mask_is_threshold_low",
    )
)


@_rule(_ALG + "policy_loss_type", _ALG + "use_tis", *_OPC_KEYS)
def _loss_without_correction(cfg: Config) -> Iterator[Violation]:
    alg = cfg.trainer.algorithm
    opc = alg.off_policy_correction
    on = [k for k in _OPC_KEYS if get_key(cfg, k) is not None] + ([_ALG + "use_tis"] if alg.use_tis else [])
    if on and not policy_loss_traits(alg.policy_loss_type).applies_off_policy_correction:
        yield Violation(
            _ALG + "policy_loss_type",
            alg.policy_loss_type,
            f"does not apply the off-policy correction "
            f"(SkyRL computes it without), which {', '.join(on)} turns on",
            f"set {_OPC}tis_ratio_type=null (and the other correction keys to null), or pick another loss",
        )
    if alg.cispo.cispo_anchor == "rollout" and (opc.tis_ratio_type is not None or alg.use_tis):
        yield Violation(
            _ALG + "cispo.cispo_anchor",
            "rollout",
            "is already the correction for the rollout policy: TIS would count it twice",
            f"set {_OPC}tis_ratio_type=null, or cispo_anchor=old",
        )


@_rule(_OPC + "token_mask_is_threshold_low", _OPC + "token_mask_is_threshold_high")
def _token_mask_both_sides(cfg: Config) -> Iterator[Violation]:
    opc = cfg.trainer.algorithm.off_policy_correction
    if (opc.token_mask_is_threshold_low is None) != (opc.token_mask_is_threshold_high is None):
        yield Violation(
            _OPC + "token_mask_is_threshold_low",
            opc.token_mask_is_threshold_low,
            "works together with token_mask_is_threshold_high (SkyRL ignores a one-sided token mask)",
            "set both thresholds, or neither",
        )


@_rule(_ALG + "use_tis", _ALG + "tis_imp_ratio_cap", _OPC + "tis_ratio_type")
def _deprecated_tis(cfg: Config) -> Iterator[Violation]:
    alg = cfg.trainer.algorithm
    if not alg.use_tis:
        return
    if alg.tis_imp_ratio_cap <= 0:
        yield Violation(
            _ALG + "tis_imp_ratio_cap",
            alg.tis_imp_ratio_cap,
            "must be > 0 with use_tis=true (it caps the token importance weights)",
            f"set {_ALG}tis_imp_ratio_cap=2.0, or better "
            f"{_OPC}tis_ratio_type=token and {_OPC}token_tis_ratio_clip_high",
        )
    if alg.off_policy_correction.tis_ratio_type == "sequence":
        yield Violation(
            _ALG + "use_tis",
            True,
            f"means token-level TIS, which contradicts {_OPC}tis_ratio_type=sequence",
            f"drop the deprecated {_ALG}use_tis",
        )


@_rule(_ALG + "on_policy_distillation", _ALG + "use_kl_in_reward")
def _distillation_replaces_kl_reward(cfg: Config) -> Iterator[Violation]:
    alg = cfg.trainer.algorithm
    if alg.on_policy_distillation and alg.use_kl_in_reward:
        yield Violation(
            _ALG + "use_kl_in_reward",
            True,
            "excludes on_policy_distillation (whose rewards are already the teacher's KL term)",
            f"set {_ALG}use_kl_in_reward=false",
        )


@_rule("trainer.update_ref_every_epoch", _ALG + "use_kl_loss", _ALG + "use_kl_in_reward",
       _ALG + "on_policy_distillation")
def _update_ref_needs_reference(cfg: Config) -> Iterator[Violation]:
    alg = cfg.trainer.algorithm
    if cfg.trainer.update_ref_every_epoch and not (alg.use_kl_loss or alg.use_kl_in_reward
                                                   or alg.on_policy_distillation):
        yield Violation(
            "trainer.update_ref_every_epoch",
            True,
            "updates the reference model, which this run does not "
            "have (nothing reads it: no KL loss, no KL in the reward, no distillation)",
            "set trainer.update_ref_every_epoch=false, or use a KL term",
        )


@_rule(
    _ALG + "overlong_buffer_len",
    _ALG + "overlong_buffer_penalty_factor",
    "generator.sampling_params.max_generate_length",
)
def _overlong_buffer(cfg: Config) -> Iterator[Violation]:
    alg, longest = cfg.trainer.algorithm, cfg.generator.sampling_params.max_generate_length
    if alg.overlong_buffer_len is not None and alg.overlong_buffer_len > longest:
        yield Violation(
            _ALG + "overlong_buffer_len",
            alg.overlong_buffer_len,
            f"must be at most the longest response (generator.sampling_params.max_generate_length={longest})",
            f"set {_ALG}overlong_buffer_len to at most {longest}",
        )
    if alg.overlong_buffer_penalty_factor < 0:
        yield Violation(
            _ALG + "overlong_buffer_penalty_factor",
            alg.overlong_buffer_penalty_factor,
            "must be >= 0",
            "e.g. 1.0",
        )


@_rule(_ALG + "value_head_prefix")
def _value_head_name(cfg: Config) -> Iterator[Violation]:
    name = cfg.trainer.algorithm.value_head_prefix
    if not name.isidentifier() or name == "model":
        yield Violation(
            _ALG + "value_head_prefix",
            name,
            "must be a Python name other than 'model' (it names the critic's value-head parameter)",
            f"write e.g. {_ALG}value_head_prefix=value_head",
        )


@_rule("trainer.critic.model.path", "trainer.train_batch_size", "trainer.critic_mini_batch_size")
def _critic_mini_batches(cfg: Config) -> Iterator[Violation]:
    t = cfg.trainer
    if (
        t.critic.model.path
        and t.critic_mini_batch_size >= 1
        and t.train_batch_size % t.critic_mini_batch_size
    ):
        yield Violation(
            "trainer.critic_mini_batch_size",
            t.critic_mini_batch_size,
            f"must divide trainer.train_batch_size ({t.train_batch_size})",
            f"set trainer.critic_mini_batch_size to a divisor of {t.train_batch_size}",
        )


@_rule(_ALG + "loss_reduction", "trainer.policy_mini_batch_size", "generator.n_samples_per_prompt",
       "trainer.micro_train_batch_size_per_gpu")
def _legacy_token_mean(cfg: Config) -> Iterator[Violation]:
    t = cfg.trainer
    rows = t.policy_mini_batch_size * cfg.generator.n_samples_per_prompt
    micro = t.micro_train_batch_size_per_gpu
    if t.algorithm.loss_reduction == "token_mean_legacy" and micro >= 1 and rows % micro:
        yield Violation(
            "trainer.micro_train_batch_size_per_gpu",
            micro,
            "must divide a mini-batch's rows (policy_"
            f"mini_batch_size * n_samples_per_prompt = {rows}) with loss_reduction=token_mean_legacy (its "
            "mean is per micro-batch; SkyRL gives the rows past the last whole one advantage 0)",
            f"set trainer.micro_train_batch_size_per_gpu to a divisor of {rows}, or "
            "loss_reduction=token_mean",
        )


@_rule("trainer.fully_async.sample_full_batch", _ALG + "zero_variance_filter")
def _sample_full_batch(cfg: Config) -> Iterator[Violation]:
    if cfg.trainer.fully_async.sample_full_batch and not cfg.trainer.algorithm.zero_variance_filter:
        yield Violation(
            "trainer.fully_async.sample_full_batch",
            True,
            f"needs {_ALG}zero_variance_filter=true (it drops the groups that filter finds)",
            f"set {_ALG}zero_variance_filter=true",
        )


@_rule(_ALG + "dynamic_sampling.type", FULLY_ASYNC)
def _dynamic_sampling_async(cfg: Config) -> Iterator[Violation]:
    if cfg.trainer.fully_async.enabled and cfg.trainer.algorithm.dynamic_sampling.type == "replace":
        yield Violation(
            _ALG + "dynamic_sampling.type",
            "replace",
            "needs a whole batch generated at once, which the fully-async trainer never has",
            f"use {_ALG}dynamic_sampling.type=filter (the "
            "fully-async trainer then drops such groups at generation and generates others)",
        )


_REPLAY = "trainer.{}.megatron_config.moe_enable_routing_replay"
_RETURN_ROUTED = "generator.inference_engine.enable_return_routed_experts"


@_rule(_REPLAY.format("policy"), _REPLAY.format("ref"), _RETURN_ROUTED)
def _routing_replay_needs_the_record(cfg: Config) -> Iterator[Violation]:
    """SkyRL's rule (without its Megatron-only part): routing replay needs the rollouts' routing
    record. (SkyRL also refuses the record without replay; here it is what the routing-mismatch
    metrics of a run without replay are measured against, so it is allowed.)"""
    returns = cfg.generator.inference_engine.enable_return_routed_experts
    for role in ("policy", "ref"):
        if getattr(cfg.trainer, role).megatron_config.moe_enable_routing_replay and not returns:
            yield Violation(
                _REPLAY.format(role),
                True,
                f"replays the rollouts' routing, which they record only with {_RETURN_ROUTED}=true",
                f"set {_RETURN_ROUTED}=true",
            )


_STEP_WISE = "generator.step_wise_trajectories"
_STEP_WISE_FIX = f"set {_STEP_WISE}=false"


@_rule(_STEP_WISE, _ALG + "advantage_estimator", _ALG + "loss_reduction", "generator.batched",
       "generator.use_conversation_multi_turn", "generator.chat_template.name_or_path", _RETURN_ROUTED)
def _step_wise_needs(cfg: Config) -> Iterator[Violation]:
    """SkyRL's rules for step-wise trajectories (its trainer's and its skyrl-gym generator's)."""
    if not cfg.generator.step_wise_trajectories:
        return
    g, alg = cfg.generator, cfg.trainer.algorithm
    if alg.advantage_estimator in ("gae", "reinforce++", "no_op"):
        yield Violation(
            _ALG + "advantage_estimator",
            alg.advantage_estimator,
            "gives per-token advantages, which "
            f"{_STEP_WISE}=true replaces by its episode's last turn's one number (SkyRL refuses gae and "
            "reinforce++; no_op is ours)",
            f"use grpo, rloo or maxrl, or {_STEP_WISE_FIX}",
        )
    if alg.loss_reduction == "token_mean_legacy":
        yield Violation(
            _ALG + "loss_reduction",
            "token_mean_legacy",
            f"is not supported with {_STEP_WISE}=true (SkyRL's rule)",
            f"use {_ALG}loss_reduction=token_mean, or {_STEP_WISE_FIX}",
        )
    if g.batched:
        yield Violation(
            "generator.batched",
            True,
            f"is not supported with {_STEP_WISE}=true (SkyRL's rule: its batched generation is single-turn)",
            f"set generator.batched=false, or {_STEP_WISE_FIX}",
        )
    if not g.use_conversation_multi_turn:
        yield Violation(
            "generator.use_conversation_multi_turn",
            False,
            "makes the episode one assistant message, "
            f"which {_STEP_WISE}=true cannot cut into turns (SkyRL's rule)",
            f"set generator.use_conversation_multi_turn=true, or {_STEP_WISE_FIX}",
        )
    if g.chat_template.name_or_path is not None:
        yield Violation("generator.chat_template.name_or_path", g.chat_template.name_or_path, "a custom chat "
                        f"template is not supported with {_STEP_WISE}=true (SkyRL's rule)",
                        f"set generator.chat_template.name_or_path=null, or {_STEP_WISE_FIX}")
    if g.inference_engine.enable_return_routed_experts:
        yield Violation(_RETURN_ROUTED, True, f"is not supported with {_STEP_WISE}=true (SkyRL's rule)",
                        f"set {_RETURN_ROUTED}=false, or {_STEP_WISE_FIX}")


_VLM = "generator.vision_language_generator"


@_rule(_VLM, "generator.batched", _STEP_WISE, "generator.use_conversation_multi_turn")
def _vision_language_generator_needs(cfg: Config) -> Iterator[Violation]:
    """SkyRL's rules for its vision-language generator (its `_validate_cfg`)."""
    g = cfg.generator
    if not g.vision_language_generator:
        return
    fix = f"or set {_VLM}=false (text prompts only)"
    if g.batched:
        yield Violation("generator.batched", True, f"is not supported with {_VLM}=true (SkyRL's rule)",
                        f"set generator.batched=false, {fix}")
    if g.step_wise_trajectories:
        yield Violation(_STEP_WISE, True, f"is not supported with {_VLM}=true (SkyRL's rule)",
                        f"{_STEP_WISE_FIX}, {fix}")
    if not g.use_conversation_multi_turn:
        yield Violation("generator.use_conversation_multi_turn", False, f"is not supported with {_VLM}=true "
                        "(SkyRL's rule: images in observations need their own user messages)",
                        f"set generator.use_conversation_multi_turn=true, {fix}")


@_rule("generator.step_wise_trajectories", "generator.merge_stepwise_output")
def _merge_needs_step_wise(cfg: Config) -> Iterator[Violation]:
    if cfg.generator.merge_stepwise_output and not cfg.generator.step_wise_trajectories:
        yield Violation(
            "generator.merge_stepwise_output",
            True,
            "merges step-wise samples, which only generator.step_wise_trajectories=true makes",
            "set generator.merge_stepwise_output=false",
        )


@_rule("generator.sampling_params.logprobs", "generator.eval_sampling_params.logprobs")
def _logprobs_zero_or_one(cfg: Config) -> Iterator[Violation]:
    for kind in ("sampling_params", "eval_sampling_params"):
        value = getattr(cfg.generator, kind).logprobs
        if value is not None and value not in (0, 1):
            yield Violation(
                f"generator.{kind}.logprobs",
                value,
                "must be 0, 1 or null (each asks only for the sampled token's log-probability)",
                f"set generator.{kind}.logprobs=1",
            )


@_rule(
    COLOCATE,
    POLICY_NODES,
    POLICY_GPUS,
    "generator.inference_engine.num_engines",
    "generator.inference_engine.device",
)
def _colocated_counts(cfg: Config) -> Iterator[Violation]:
    """SkyRL's rule on GPUs: colocated, each GPU holds one policy rank and one engine. (On CPU the
    engines share the host's memory with the trainer whatever their number.)"""
    placement, ie = cfg.trainer.placement, cfg.generator.inference_engine
    ranks = placement.policy_num_nodes * placement.policy_num_gpus_per_node
    on_gpus = ie.device.startswith("cuda")
    if on_gpus and placement.colocate_all and ranks >= 1 and ie.num_engines >= 1 and ranks != ie.num_engines:
        yield Violation(
            COLOCATE,
            True,
            f"needs one engine per policy rank: {POLICY_NODES} * {POLICY_GPUS} = {ranks} "
            f"but generator.inference_engine.num_engines = {ie.num_engines}",
            f"set generator.inference_engine.num_engines={ranks}, or {COLOCATE}=false",
        )


@_rule(FULLY_ASYNC, "trainer.train_batch_size", "trainer.policy_mini_batch_size")
def _batch_sizes(cfg: Config) -> Iterator[Violation]:
    t = cfg.trainer
    train, mini = t.train_batch_size, t.policy_mini_batch_size
    if train < 1 or mini < 1:
        return  # reported by the range rules
    if t.fully_async.enabled and train != mini:
        yield Violation(
            "trainer.train_batch_size", train,
            f"must equal trainer.policy_mini_batch_size ({mini}) when {FULLY_ASYNC}=true (one optimizer "
            "step per sync)",
            f"set trainer.train_batch_size={mini}",
        )  # fmt: skip
    elif train % mini:
        yield Violation(
            "trainer.train_batch_size", train,
            f"must be a multiple of trainer.policy_mini_batch_size ({mini})",
            f"set trainer.train_batch_size={max(1, train // mini) * mini}",
        )  # fmt: skip


@_rule(
    FULLY_ASYNC, "trainer.policy_mini_batch_size", "trainer.fully_async.max_staleness_steps",
    "trainer.fully_async.num_parallel_generation_workers",
)  # fmt: skip
def _generation_workers(cfg: Config) -> Iterator[Violation]:
    fa, mini = cfg.trainer.fully_async, cfg.trainer.policy_mini_batch_size
    if not fa.enabled or mini < 1 or fa.max_staleness_steps < 0 or fa.num_parallel_generation_workers < 1:
        return
    low, high = mini, mini * (fa.max_staleness_steps + 1)
    if not low <= fa.num_parallel_generation_workers <= high:
        key = "trainer.fully_async.num_parallel_generation_workers"
        yield Violation(
            key, fa.num_parallel_generation_workers,
            "must be in [policy_mini_batch_size, policy_mini_batch_size * (max_staleness_steps + 1)] = "
            f"[{low}, {high}] (fewer starves the trainer; more is wasted by the staleness limit; SkyRL's "
            "fully-async trainer asserts the same)",
            f"set {key}={mini * (fa.max_staleness_steps // 2 + 1)}",
        )  # fmt: skip


ENGINE_RESTARTS = "trainer.fully_async.engine_restarts"
_BACKEND = "generator.inference_engine.weight_sync_backend"


@_rule(ENGINE_RESTARTS, FULLY_ASYNC, _BACKEND)
def _engine_restarts(cfg: Config) -> Iterator[Violation]:
    restarts = cfg.trainer.fully_async.engine_restarts
    if restarts <= 0:
        return
    if not cfg.trainer.fully_async.enabled:
        yield Violation(ENGINE_RESTARTS, restarts, "restarts engines of the fully-async trainer only",
                        f"set {FULLY_ASYNC}=true or {ENGINE_RESTARTS}=0")
        return
    backend = cfg.generator.inference_engine.weight_sync_backend
    transport = weight_transport(backend)
    if transport is not None and transport.in_trainer_process:
        yield Violation(
            ENGINE_RESTARTS,
            restarts,
            f"restarts engine processes; with weight_sync_backend={backend} "
            "the engines run in the trainer's process",
            f"set {_BACKEND}=shm (or broadcast)",
        )


@_rule("trainer.strategy", MEGATRON_TP, POLICY_NODES, POLICY_GPUS)
def _tensor_parallel_divides_policy_ranks(cfg: Config) -> Iterator[Violation]:
    placement, tp = cfg.trainer.placement, cfg.trainer.policy.megatron_config.tensor_model_parallel_size
    ranks = placement.policy_num_nodes * placement.policy_num_gpus_per_node
    if cfg.trainer.strategy != "megatron" or tp < 1 or ranks < 1 or ranks % tp == 0:
        return
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    yield Violation(
        MEGATRON_TP, tp,
        f"must divide the policy's ranks ({POLICY_NODES} * {POLICY_GPUS} = {ranks}): each rank holds "
        "one slice of a tensor-parallel group",
        f"set {MEGATRON_TP} to one of {divisors}, or {POLICY_GPUS} to a multiple of {tp}",
    )  # fmt: skip


_FSDP_SIZES = tuple(f"trainer.{role}.fsdp_config.fsdp_size" for role in ("policy", "ref", "critic"))


@_rule(*_FSDP_SIZES, POLICY_NODES, POLICY_GPUS)
def _fsdp_size_divides_policy_ranks(cfg: Config) -> Iterator[Violation]:
    placement = cfg.trainer.placement
    ranks = placement.policy_num_nodes * placement.policy_num_gpus_per_node
    for key, role in zip(_FSDP_SIZES, ("policy", "ref", "critic"), strict=True):
        size = getattr(cfg.trainer, role).fsdp_config.fsdp_size
        if ranks >= 1 and 0 <= size < ranks and (size == 0 or ranks % size):
            divisors = [d for d in range(1, ranks) if ranks % d == 0]
            yield Violation(
                key,
                size,
                f"must divide the policy's ranks ({POLICY_NODES} * {POLICY_GPUS} = {ranks}): "
                "each replica is sharded over fsdp_size ranks (hybrid sharding)",
                f"set {key} to one of {divisors}, or -1 (shard over every rank)",
            )


# ---- data and environment (your own data: data.*, trainer.max_prompt_length, environment.env_class) ----
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
_MODULE_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_range_rule("trainer.max_prompt_length", lambda v: v >= 1, "must be >= 1",
            "set trainer.max_prompt_length to the longest prompt to keep, in tokens (SkyRL: 512)")
_range_rule("data.val_fraction", lambda v: 0 < v < 1, "must be in (0, 1)",
            "e.g. data.val_fraction=0.1, or give data.val_data")


def _data_paths_rule(key: str) -> None:
    def check(cfg: Config) -> Iterator[Violation]:
        for path in get_key(cfg, key):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if not path.strip():
                yield Violation(key, path, "holds an empty path", f"give {key}=[path.parquet, ...]")
            elif "." in name and not name.endswith(DATA_SUFFIXES):
                yield Violation(key, path, "is not a .parquet, .jsonl or .json file",
                                "convert it, or give a directory written by datasets' save_to_disk")

    _rule(key)(check)


for _key in ("data.train_data", "data.val_data"):
    _data_paths_rule(_key)


@_rule("environment.env_class")
def _env_class_known(cfg: Config) -> Iterator[Violation]:
    """A malformed `package.module:name` is a violation; a plain name not registered yet is not (your
    code may register it before the run, as SkyRL's example entry points register theirs): a run
    refuses it then (`env_class_problem`, through `inflight.config.implemented.unimplemented`)."""
    from inflight.rewards.hubs import hub_prefixes  # stdlib only

    name = cfg.environment.env_class
    if name is not None and ":" in name and not name.startswith(hub_prefixes()) \
            and not _MODULE_NAME.match(name):
        yield Violation("environment.env_class", name, "is not of the form package.module:name",
                        "write e.g. environment.env_class=my_rewards:score")


@_rule("environment.env_class", "environment.verifiers", "generator.agent.path")
def _verifiers_environment(cfg: Config) -> Iterator[Violation]:
    """`verifiers:<env id>` names an id and plays the episodes itself; its loader's arguments need it."""
    from inflight.rewards.hubs import agent_hub  # stdlib only

    name, hub = cfg.environment.env_class, agent_hub(cfg.environment.env_class)
    env_id = hub[1] if hub is not None else None
    if env_id is not None and not env_id.strip():
        yield Violation("environment.env_class", name, "names no verifiers environment",
                        "write environment.env_class=verifiers:<env id>, e.g. verifiers:wordle")
    if env_id is not None and cfg.generator.agent.path is not None:
        yield Violation(
            "generator.agent.path",
            cfg.generator.agent.path,
            f"is set, but environment.env_class={name} "
            "plays the episodes (through the agent endpoint) itself",
            "drop generator.agent.path, or set environment.env_class to another environment",
        )
    if cfg.environment.verifiers and env_id is None:
        yield Violation("environment.verifiers", cfg.environment.verifiers, "is read only with "
                        "environment.env_class=verifiers:<env id> (the environment's loader's arguments)",
                        "drop environment.verifiers, or set environment.env_class=verifiers:<env id>")


def env_class_problem(name: str | None) -> Violation | None:
    """Why a run cannot score with `environment.env_class` = `name` (not registered), or None."""
    from inflight.rewards.hubs import UnknownEnvironment, find_hub  # stdlib only

    if name is None:
        return None
    try:
        find_hub(name)
    except UnknownEnvironment as err:  # its message lists the environment hubs
        return Violation("environment.env_class", name, err.rule, err.fix)
    return None


@_rule("data.val_data", "data.train_data")
def _val_needs_train(cfg: Config) -> Iterator[Violation]:
    if cfg.data.val_data and not cfg.data.train_data:
        yield Violation("data.val_data", cfg.data.val_data, "is given without data.train_data",
                        "give data.train_data too (the built-in tasks make their own held-out problems)")


# ---- where the engines run: started here (native, vllm servers) or external servers ----
BACKEND = "generator.inference_engine.backend"
VLLM_PYTHON = "generator.inference_engine.vllm_python"
RUN_LOCALLY = "generator.inference_engine.run_engines_locally"
EXTERNAL_URLS = "generator.inference_engine.external_server_urls"
NUM_ENGINES = "generator.inference_engine.num_engines"


def _url_problem(url: str) -> str | None:
    """Why `url` is not a server's base URL (`http://host:port`), or None."""
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a port out of range or not a number
    except ValueError as err:
        return str(err)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "is not an http(s)://host:port URL"
    if parts.path.strip("/") or parts.query or parts.fragment:
        return "has a path, query or fragment (give the server's base URL only)"
    return None


@_rule(RUN_LOCALLY, EXTERNAL_URLS, NUM_ENGINES)
def _external_servers(cfg: Config) -> Iterator[Violation]:
    ie = cfg.generator.inference_engine
    urls = ie.external_server_urls or []
    if ie.run_engines_locally:
        if urls:
            yield Violation(
                EXTERNAL_URLS,
                urls,
                f"is read only with {RUN_LOCALLY}=false (the run starts its own engines)",
                f"set {RUN_LOCALLY}=false to drive these servers, or {EXTERNAL_URLS}=null",
            )
        return
    if not urls:
        yield Violation(EXTERNAL_URLS, ie.external_server_urls, f"must list the servers to drive when "
                        f"{RUN_LOCALLY}=false", f"give {EXTERNAL_URLS}=[http://host:port,...], or set "
                        f"{RUN_LOCALLY}=true to start the engines here")
        return
    for url in urls:
        problem = _url_problem(url)
        if problem:
            yield Violation(
                EXTERNAL_URLS,
                url,
                problem,
                f"write each server as e.g. http://10.0.0.5:8000 in {EXTERNAL_URLS}",
            )
    normalized = [u.strip().rstrip("/") for u in urls]
    if len(set(normalized)) < len(normalized):
        yield Violation(EXTERNAL_URLS, urls, "names a server twice", "list each server once")
    if ie.num_engines >= 1 and ie.num_engines != len(urls):
        yield Violation(
            NUM_ENGINES,
            ie.num_engines,
            f"must equal the number of {EXTERNAL_URLS} ({len(urls)}) when {RUN_LOCALLY}=false",
            f"set {NUM_ENGINES}={len(urls)}",
        )


@_rule(BACKEND, VLLM_PYTHON, RUN_LOCALLY)
def _vllm_python(cfg: Config) -> Iterator[Violation]:
    ie = cfg.generator.inference_engine
    if ie.vllm_python is None:
        return
    readers = entries_with_setting("vllm_python")
    if ie.backend not in readers:
        yield Violation(VLLM_PYTHON, ie.vllm_python, f"is read only with {BACKEND}={' or '.join(readers)}",
                        f"set {BACKEND}={readers[0]}, or {VLLM_PYTHON}=null")
    elif not ie.run_engines_locally:
        yield Violation(VLLM_PYTHON, ie.vllm_python, f"is not used with {RUN_LOCALLY}=false (servers started "
                        "elsewhere run their own vLLM)", f"set {VLLM_PYTHON}=null, or {RUN_LOCALLY}=true")
    elif not ie.vllm_python.strip():
        yield Violation(VLLM_PYTHON, ie.vllm_python, "is empty", f"give the venv's python, e.g. "
                        f"{VLLM_PYTHON}=.venv-vllm/bin/python, or {VLLM_PYTHON}=null for the default")
