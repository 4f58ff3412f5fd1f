"""validate(): every violation at once, with key, value, rule and fix; did-you-mean; types; ranges."""

from __future__ import annotations

import pytest

from inflight.config import Config, ConfigError, Violation, collect_violations, load_config, validate
from inflight.testing import LOCAL_CPU

FA = "trainer.fully_async."
IE = "generator.inference_engine."
TP = "trainer.policy.megatron_config.tensor_model_parallel_size"
GPUS = "trainer.placement.policy_num_gpus_per_node"


def _violations(*overrides: str) -> list[Violation]:
    """The violations of `overrides` over the local CPU baseline (fully async, small batches)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, *overrides])
    return err.value.violations


def _one(*overrides: str) -> Violation:
    (v,) = _violations(*overrides)
    return v


def test_default_config_is_valid():
    validate(Config())
    assert collect_violations(Config()) == []


def test_every_violation_is_listed_at_once():
    err_overrides = [
        f"{FA}enabled=true",  # colocated engines (SkyRL's default) exclude it
        f"{IE}offload_kv_for_weight_sync=true",  # needs non-colocated
        "trainer.placement.policy_num_gpus_per_node=2",  # colocated on GPUs: one engine per policy rank
        f"{IE}device=cuda",
        "trainer.epochs=-1",  # range
        "trainer.seed=abc",  # type
        "trainer.placment.colocate_all=false",  # unknown, did-you-mean
        "trainer.strategy=deepspeed",  # choice
    ]
    with pytest.raises(ConfigError) as err:
        load_config(None, err_overrides)
    keys = err.value.keys
    assert sorted(keys) == sorted(
        [
            "trainer.placment.colocate_all",
            "trainer.seed",
            "trainer.epochs",
            "trainer.strategy",
            "trainer.placement.colocate_all",
            "trainer.placement.colocate_all",
            f"{IE}offload_kv_for_weight_sync",
            "trainer.train_batch_size",  # fully async: one mini-batch per step (SkyRL's 1024 vs 256)
        ]
    )
    message = str(err.value)
    assert message.startswith("8 configuration violations:")
    for v in err.value.violations:
        assert v.key in message and v.rule in message and v.fix in message


def test_violation_carries_key_value_rule_and_fix():
    v = _one(f"{FA}num_parallel_generation_workers=4")
    assert v.key == f"{FA}num_parallel_generation_workers"
    assert v.value == 4
    assert "[8, 40]" in v.rule
    assert v.fix == f"set {FA}num_parallel_generation_workers=24"
    assert str(v).startswith(f"{FA}num_parallel_generation_workers=4: ")


@pytest.mark.parametrize(
    ("overrides", "rule", "fix"),
    [
        ([f"{FA}engine_restarts=-1"], "must be >= 0", f"set {FA}engine_restarts to 0 or more"),
        (
            [f"{FA}engine_restarts=2", f"{IE}weight_sync_backend=inprocess"],
            "weight_sync_backend=inprocess",
            f"set {IE}weight_sync_backend=shm (or broadcast)",
        ),
        (
            [f"{FA}engine_restarts=2", f"{FA}enabled=false", f"{IE}weight_sync_backend=shm"],
            "fully-async trainer only",
            f"set {FA}enabled=true or {FA}engine_restarts=0",
        ),
    ],
)
def test_engine_restarts_need_engine_processes_of_the_fully_async_trainer(overrides, rule, fix):
    v = _one(*overrides)
    assert v.key == f"{FA}engine_restarts" and rule in v.rule and v.fix == fix
    load_config(None, [*LOCAL_CPU, f"{FA}engine_restarts=2", f"{IE}weight_sync_backend=broadcast"])  # valid


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("trainer.placement.colocate=false", "trainer.placement.colocate_all"),
        ("trainer.fully_async.enable=true", "trainer.fully_async.enabled"),
        ("trainer.fully_async.clear_kv_cache_on_weights_sync=true", f"{FA}clear_kv_cache_on_weight_sync"),
        ("trainer.placment.colocate_all=false", "trainer.placement.colocate_all"),
        ("trainer.enable_prefix_caching=false", f"{IE}enable_prefix_caching"),
        ("generator.offload_kv_for_weight_sync=true", f"{IE}offload_kv_for_weight_sync"),
        ("trainer.lr=1e-5", "trainer.policy.optimizer_config.lr"),
        (
            "generator.sampling_params.max_generation_length=8",
            "generator.sampling_params.max_generate_length",
        ),
        ("genrator.inference_engine.block_size=8", f"{IE}block_size"),
    ],
)
def test_unknown_keys_suggest_the_closest_known_key(typo, suggestion):
    v = _one(typo)
    assert v.key == typo.split("=")[0]
    assert v.rule == "unknown key"
    assert v.fix == f"did you mean '{suggestion}'?"


def test_unknown_key_without_a_close_match_says_remove_it():
    v = _one("zzz.qqq=1")
    assert v.rule == "unknown key" and v.fix.startswith("remove it")


def test_unknown_keys_in_yaml_are_reported_with_their_full_dotted_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  fully_async:\n    max_stalenes_steps: 2\n  extra: {}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.keys == ["trainer.fully_async.max_stalenes_steps", "trainer.extra"]
    assert err.value.violations[0].fix == f"did you mean '{FA}max_staleness_steps'?"


def test_a_section_given_a_value_is_an_error():
    v = _one("trainer.placement=true")
    assert v.key == "trainer.placement" and "section" in v.rule


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.train_batch_size=abc", "expected int, got str 'abc'"),
        ("trainer.train_batch_size=2.5", "expected int, got float 2.5"),
        ("trainer.train_batch_size=true", "expected int, got bool True"),
        ("trainer.placement.colocate_all=2", "expected bool, got int 2"),
        ("trainer.placement.colocate_all=maybe", "expected bool, got str 'maybe'"),
        ("trainer.policy.optimizer_config.lr=fast", "expected float, got str 'fast'"),
        ("trainer.policy.optimizer_config.adam_betas=0.9", "expected list[float], got float 0.9"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9, x]", "expected list[float], got list [0.9, 'x']"),
        ("trainer.strategy=[fsdp]", "expected str, got list ['fsdp']"),
        ("trainer.policy.model.path=3", "expected str or null, got int 3"),
        (f"{IE}num_kv_blocks=many", "expected int or null, got str 'many'"),
        ("generator.sampling_params.stop=eos", "expected list[str] or null, got str 'eos'"),
        ("trainer.epochs={a: 1}", "expected int, got dict {'a': 1}"),
    ],
)
def test_type_errors_name_the_expected_type(override, expected):
    v = _one(override)
    assert v.key == override.split("=")[0]
    assert v.rule == expected
    assert v.fix.startswith(f"write e.g. {v.key}=")


def test_a_type_error_suppresses_the_rules_that_read_that_key():
    # train_batch_size has the wrong type: the fully-async equality rule must not also fire.
    v = _one("trainer.train_batch_size=big")
    assert v.rule.startswith("expected int")


def test_validate_catches_values_set_in_code():
    cfg = Config()
    cfg.trainer.epochs = "2"  # type: ignore[assignment]
    cfg.generator.inference_engine.block_size = 0
    cfg.trainer.strategy = "jax"
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.keys == ["trainer.epochs", f"{IE}block_size", "trainer.strategy"]


def test_validate_accepts_skyrl_value_aliases_set_in_code():
    cfg = Config()
    cfg.trainer.strategy = "fsdp2"
    cfg.generator.inference_engine.weight_sync_backend = "nccl"
    validate(cfg)


@pytest.mark.parametrize(
    ("override", "rule"),
    [
        ("trainer.train_batch_size=0", "must be >= 1"),
        ("trainer.policy_mini_batch_size=-8", "must be >= 1"),
        ("trainer.micro_train_batch_size_per_gpu=0", "must be >= 1"),
        ("trainer.epochs=0", "must be >= 1"),
        ("generator.n_samples_per_prompt=0", "must be >= 1"),
        (f"{IE}num_engines=0", "must be >= 1"),
        (f"{IE}tensor_parallel_size=0", "must be >= 1"),
        (f"{IE}block_size=-16", "must be >= 1"),
        (f"{IE}max_num_seqs=0", "must be >= 1"),
        (f"{IE}max_num_batched_tokens=0", "must be >= 1"),
        (f"{IE}num_kv_blocks=0", "must be >= 1 or null"),
        (f"{IE}max_model_len=-1", "must be >= 1 or null"),
        (f"{IE}kv_cache_memory_gib=0", "must be > 0 or null"),
        ("generator.sampling_params.max_generate_length=0", "must be >= 1"),
        (f"{FA}max_staleness_steps=-1", "must be >= 0"),
        ("trainer.policy.model.lora.rank=-4", "must be >= 0"),
        ("trainer.seed=-1", "must be >= 0"),
        ("trainer.policy.optimizer_config.lr=0", "must be > 0"),
        ("trainer.policy.optimizer_config.weight_decay=-0.1", "must be >= 0"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9]", "must be two values in [0, 1)"),
        ("trainer.policy.optimizer_config.adam_betas=[0.9, 1.0]", "must be two values in [0, 1)"),
        ("trainer.algorithm.eps_clip_low=-0.2", "must be >= 0"),
        ("generator.sampling_params.temperature=-1", "must be >= 0"),
        ("generator.sampling_params.top_p=0", "must be in (0, 1]"),
        ("generator.sampling_params.top_p=1.5", "must be in (0, 1]"),
        ("generator.sampling_params.top_k=-2", "must be >= -1"),
        ("trainer.policy.model.lora.dropout=1", "must be in [0, 1)"),
        (f"{IE}device=gpu", "must be a torch device: cpu, cuda, cuda:N or mps"),
        (f"{TP}=0", "must be >= 1"),
        ("trainer.placement.policy_num_nodes=0", "must be >= 1"),
        ("trainer.placement.policy_num_gpus_per_node=-2", "must be >= 1"),
        (f"{IE}weight_sync_port=-1", "must be in [0, 65535]"),
        (f"{IE}weight_sync_port=65536", "must be in [0, 65535]"),
        (f"{IE}weight_sync_chunk_size_mb=0", "must be > 0 or null"),
        (f"{IE}weight_sync_host=' '", "must not be empty"),
    ],
)
def test_values_out_of_range(override, rule):
    key, value = override.split("=")
    v = next(v for v in _violations(override) if v.key == key)
    assert v.rule == rule
    assert key in v.fix or v.fix.startswith("use ")


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("trainer.strategy=megatorn", "did you mean 'megatron'?"),
        (f"{IE}weight_sync_backend=ncl", "did you mean 'nccl'?"),
        (f"{IE}weight_sync_backend=tcp", ""),
        ("trainer.algorithm.loss_reduction=token_sum", ""),
        (f"{IE}model_dtype=fp8", ""),
    ],
)
def test_choices(override, hint):
    v = _one(override)
    assert v.rule.startswith("must be one of ")
    assert v.fix.startswith(hint) and "use one of" in v.fix


@pytest.mark.parametrize("value", ["inprocess", "shm", "broadcast", "nccl", "gloo", "cuda_ipc"])
def test_weight_sync_backends(value):
    load_config(None, [*LOCAL_CPU, f"{IE}weight_sync_backend={value}"])


# --- combination rules -------------------------------------------------------------------------


def test_colocate_all_excludes_fully_async():
    v = _one("trainer.placement.colocate_all=true")
    assert v.key == "trainer.placement.colocate_all"
    assert "trainer.fully_async.enabled=true" in v.rule
    assert "trainer.placement.colocate_all=false" in v.fix and "trainer.fully_async.enabled=false" in v.fix
    load_config(None, [*LOCAL_CPU, "trainer.placement.colocate_all=true", f"{FA}enabled=false"])


def test_offload_kv_needs_non_colocated():
    vs = _violations(
        "trainer.placement.colocate_all=true", f"{FA}enabled=false", f"{IE}offload_kv_for_weight_sync=true"
    )
    assert [(v.key, v.value) for v in vs] == [(f"{IE}offload_kv_for_weight_sync", True)]
    assert "non-colocated" in vs[0].rule


def test_lora_runs_with_sleeping_engines_and_on_megatron_and_is_refused_by_a_run_on_several_fsdp_ranks():
    from inflight.config.implemented import unimplemented

    for extra in ([f"{IE}offload_kv_for_weight_sync=true"], ["trainer.placement.colocate_all=true",
                                                            "trainer.fully_async.enabled=false"],
                  ["trainer.strategy=megatron"]):
        assert (
            unimplemented(load_config(None, [*LOCAL_CPU, "trainer.policy.model.lora.rank=16", *extra])) == []
        )
    (v,) = unimplemented(load_config(None, [*LOCAL_CPU, "trainer.policy.model.lora.rank=16",
                                            "trainer.placement.policy_num_nodes=2"]))
    assert "more than one FSDP policy rank" in v.rule


def test_fully_async_needs_train_batch_equal_to_mini_batch():
    v = _one("trainer.train_batch_size=16")
    assert v.key == "trainer.train_batch_size" and v.value == 16
    assert "must equal trainer.policy_mini_batch_size (8)" in v.rule
    assert v.fix == "set trainer.train_batch_size=8"


def test_synchronous_trainer_needs_train_batch_multiple_of_mini_batch():
    load_config(None, [*LOCAL_CPU, f"{FA}enabled=false", "trainer.train_batch_size=16"])
    v = _one(f"{FA}enabled=false", "trainer.train_batch_size=12")
    assert (
        "multiple of trainer.policy_mini_batch_size (8)" in v.rule
        and v.fix == "set trainer.train_batch_size=8"
    )


@pytest.mark.parametrize(("workers", "ok"), [(7, False), (8, True), (24, True), (40, True), (41, False)])
def test_generation_workers_between_mini_batch_and_staleness_bound(workers, ok):
    overrides = [f"{FA}num_parallel_generation_workers={workers}"]  # mini 8, staleness 4: [8, 40]
    if ok:
        load_config(None, overrides)
    else:
        assert _one(*overrides).key == f"{FA}num_parallel_generation_workers"


def test_generation_workers_bound_follows_staleness():
    load_config(None, [*LOCAL_CPU, f"{FA}max_staleness_steps=0", f"{FA}num_parallel_generation_workers=8"])
    v = _one(f"{FA}max_staleness_steps=0")  # default 24 workers > 8 * (0 + 1)
    assert "[8, 8]" in v.rule and v.fix == f"set {FA}num_parallel_generation_workers=8"


def test_fully_async_rules_do_not_apply_to_the_synchronous_trainer():
    load_config(
        None,
        [
            *LOCAL_CPU,
            f"{FA}enabled=false",
            f"{FA}num_parallel_generation_workers=1",
            "trainer.train_batch_size=32",
        ],
    )


# --- megatron tensor parallelism -----------------------------------------------------------------


def test_tensor_parallel_size_must_divide_the_policy_ranks():
    v = _one("trainer.strategy=megatron", f"{TP}=3", f"{GPUS}=4")
    assert (v.key, v.value) == (TP, 3)
    assert "must divide the policy's ranks" in v.rule and "= 4" in v.rule
    assert v.fix == f"set {TP} to one of [1, 2, 4], or {GPUS} to a multiple of 3"
    cfg = load_config(
        None,
        [
            *LOCAL_CPU,
            "trainer.strategy=megatron",
            f"{TP}=2",
            f"{GPUS}=2",
            "trainer.placement.policy_num_nodes=3",
        ],
    )
    assert cfg.trainer.policy.megatron_config.tensor_model_parallel_size == 2


def test_tensor_parallel_rule_reads_only_megatron_runs():
    load_config(None, [*LOCAL_CPU, f"{TP}=2"])  # fsdp (the default) does not use it


def test_tensor_parallel_violation_is_listed_with_the_others():
    keys = [
        v.key for v in _violations("trainer.strategy=megatron", f"{TP}=2", "trainer.epochs=0", f"{TP}x=1")
    ]
    assert sorted(keys) == sorted([f"{TP}x", "trainer.epochs", TP])


def test_tensor_parallel_size_type_error_is_reported_once():
    v = _one("trainer.strategy=megatron", f"{TP}=two")
    assert v.rule == "expected int, got str 'two'"
