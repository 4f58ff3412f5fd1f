"""Loading: YAML files (nested, dotted, mixed), dotted overrides and their value parsing, aliases."""

from __future__ import annotations

import pytest

from inflight.config import Config, ConfigError, config_from_dict, dump_config, load_config, parse_override


def test_defaults_load_and_equal_the_schema_defaults():
    assert load_config(None) == Config()
    assert load_config(None, []) == load_config()


OVERRIDES = [
    ("trainer.fully_async.enabled=false", "trainer.fully_async.enabled", False),
    ("generator.inference_engine.enable_prefix_caching=False",
     "generator.inference_engine.enable_prefix_caching", False),
    ("generator.inference_engine.enable_chunked_prefill=off",
     "generator.inference_engine.enable_chunked_prefill", False),
    ("trainer.algorithm.use_kl_loss=yes", "trainer.algorithm.use_kl_loss", True),
    ("trainer.epochs=3", "trainer.epochs", 3),
    ("trainer.seed='7'", "trainer.seed", 7),
    ("trainer.policy.optimizer_config.lr=1e-5", "trainer.policy.optimizer_config.lr", 1e-5),
    ("trainer.policy.optimizer_config.lr=3.0e-4", "trainer.policy.optimizer_config.lr", 3e-4),
    ("generator.sampling_params.temperature=0", "generator.sampling_params.temperature", 0.0),
    ("generator.sampling_params.top_p=0.95", "generator.sampling_params.top_p", 0.95),
    ("generator.sampling_params.top_k=-1", "generator.sampling_params.top_k", -1),
    ("trainer.policy.model.path=Qwen/Qwen2.5-0.5B", "trainer.policy.model.path", "Qwen/Qwen2.5-0.5B"),
    ("trainer.policy.model.path='/tmp/a b'", "trainer.policy.model.path", "/tmp/a b"),
    ("trainer.ckpt_path=/ckpt/x=1", "trainer.ckpt_path", "/ckpt/x=1"),
    ("trainer.resume_path=null", "trainer.resume_path", None),
    ("trainer.resume_path=None", "trainer.resume_path", None),
    ("generator.inference_engine.num_kv_blocks=128", "generator.inference_engine.num_kv_blocks", 128),
    ("generator.inference_engine.dtype=bf16", "generator.inference_engine.model_dtype", "bfloat16"),
    ("trainer.policy.optimizer_config.adam_betas=[0.9, 0.95]",
     "trainer.policy.optimizer_config.adam_betas", [0.9, 0.95]),
    ("trainer.policy.optimizer_config.adam_betas=[0,0.5]",
     "trainer.policy.optimizer_config.adam_betas", [0.0, 0.5]),
    ("generator.sampling_params.stop=[</s>, '\\n\\n']", "generator.sampling_params.stop", ["</s>", "\\n\\n"]),
    ("generator.sampling_params.stop=[]", "generator.sampling_params.stop", []),
    ("+trainer.epochs=2", "trainer.epochs", 2),
    (" trainer.epochs = 4 ", "trainer.epochs", 4),
]  # fmt: skip


@pytest.mark.parametrize(("override", "key", "value"), OVERRIDES, ids=[row[0].strip() for row in OVERRIDES])
def test_override_values_are_parsed_to_the_field_type(override, key, value):
    cfg = load_config(None, [override])
    got = cfg
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value and type(got) is type(value)


def test_parse_override_reports_malformed_ones():
    problems = []
    assert parse_override("trainer.epochs", problems) is None
    assert parse_override("=3", problems) is None
    assert [p.key for p in problems] == ["trainer.epochs", "=3"]
    with pytest.raises(ConfigError, match="must be `key=value`"):
        load_config(None, ["trainer.epochs"])


def test_later_overrides_win_and_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  epochs: 5\n  seed: 1\n")
    cfg = load_config(path, ["trainer.epochs=6", "trainer.epochs=7"])
    assert (cfg.trainer.epochs, cfg.trainer.seed) == (7, 1)


def test_yaml_nested_dotted_and_mixed_forms_are_equal(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        "trainer:\n  placement:\n    colocate_all: false\n  fully_async:\n    enabled: false\n"
        "generator:\n  inference_engine:\n    enable_prefix_caching: false\n    block_size: 32\n"
    )
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text(
        "trainer.placement.colocate_all: false\ntrainer.fully_async.enabled: false\n"
        "generator.inference_engine.enable_prefix_caching: false\ngenerator.inference_engine.block_size: 32\n"
    )
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(
        "trainer:\n  placement.colocate_all: false\n  fully_async: {enabled: false}\n"
        "generator.inference_engine:\n  enable_prefix_caching: false\n  block_size: 32\n"
    )
    a, b, c = (load_config(p) for p in (nested, dotted, mixed))
    assert a == b == c
    assert a.generator.inference_engine.block_size == 32 and not a.trainer.fully_async.enabled


def test_yaml_floats_written_without_a_dot_are_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer.policy.optimizer_config:\n  lr: 1e-6\n  weight_decay: 1e-2\n")
    opt = load_config(path).trainer.policy.optimizer_config
    assert (opt.lr, opt.weight_decay) == (1e-6, 1e-2)


def test_empty_yaml_and_empty_sections_are_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    sections = tmp_path / "sections.yaml"
    sections.write_text("trainer: {}\ngenerator:\n")
    assert load_config(empty) == Config()
    assert load_config(sections) == Config()


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_invalid_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("given", "key", "value"),
    [
        ("trainer.strategy=fsdp2", "trainer.strategy", "fsdp"),
        ("generator.inference_engine.weight_sync_backend=nccl",
         "generator.inference_engine.weight_sync_backend", "broadcast"),
        ("generator.inference_engine.weight_sync_backend=gloo",
         "generator.inference_engine.weight_sync_backend", "broadcast"),
        ("generator.inference_engine.weight_sync_backend=cuda_ipc",
         "generator.inference_engine.weight_sync_backend", "shm"),
        ("generator.num_inference_engines=2", "generator.inference_engine.num_engines", 2),
        ("generator.inference_engine_tensor_parallel_size=2",
         "generator.inference_engine.tensor_parallel_size", 2),
        ("generator.weight_sync_backend=shm", "generator.inference_engine.weight_sync_backend", "shm"),
        ("generator.enable_prefix_caching=false", "generator.inference_engine.enable_prefix_caching", False),
        ("generator.model_dtype=float32", "generator.inference_engine.model_dtype", "float32"),
        ("generator.inference_engine.model_dtype=float16",
         "generator.inference_engine.model_dtype", "float16"),
    ],
)  # fmt: skip
def test_skyrl_names_and_values_are_read_as_ours(given, key, value):
    got = load_config(None, [given, "trainer.placement.colocate_all=false"])
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value


def test_skyrl_alias_in_a_nested_yaml(tmp_path):
    path = tmp_path / "skyrl.yaml"
    path.write_text(
        "generator:\n  num_inference_engines: 3\n  inference_engine:\n    model_dtype: float16\n"
        "trainer:\n  placement:\n    colocate_all: false\n"
    )
    engine = load_config(path).generator.inference_engine
    assert (engine.num_engines, engine.model_dtype) == (3, "float16")


def test_dump_round_trips(tmp_path):
    cfg = load_config(
        None,
        [
            "trainer.policy.optimizer_config.adam_betas=[0.8,0.9]",
            "generator.sampling_params.stop=[x]",
            "trainer.seed=3",
        ],
    )
    path = tmp_path / "dump.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_config_from_dict_accepts_nested_and_dotted():
    cfg = config_from_dict(
        {"trainer": {"epochs": 2}, "generator.n_samples_per_prompt": 8}, ["trainer.seed=0"]
    )
    assert (cfg.trainer.epochs, cfg.generator.n_samples_per_prompt, cfg.trainer.seed) == (2, 8, 0)


def test_a_single_override_string_is_one_override():
    assert load_config(None, "trainer.epochs=2").trainer.epochs == 2  # type: ignore[arg-type]


def test_engine_init_kwargs_entries_naming_our_keys_set_them_and_the_rest_stay_vllms():
    ie = load_config(None, ["generator.inference_engine.engine_init_kwargs.max_model_len=4096",
                            "generator.inference_engine.engine_init_kwargs.enable_log_requests=false",
                            'generator.chat_template_kwargs={enable_thinking: false}']).generator
    assert ie.inference_engine.max_model_len == 4096
    assert ie.inference_engine.engine_init_kwargs == {"enable_log_requests": False}
    assert ie.chat_template_kwargs == {"enable_thinking": False}


def test_keys_skyrl_removed_are_dropped_or_refused_as_skyrl_does():
    load_config(None, ["generator.inference_engine.async_engine=true"])  # SkyRL drops it
    with pytest.raises(ConfigError) as err:
        load_config(None, ["generator.inference_engine.async_engine=false",
                           "generator.inference_engine.enable_http_endpoint=true"])
    assert err.value.keys == ["generator.inference_engine.async_engine",
                              "generator.inference_engine.enable_http_endpoint"]
    assert load_config(None, ["trainer.use_sample_packing=false"]).trainer.remove_microbatch_padding is False
