"""The keys of where the engines run (`generator.inference_engine.backend`, `vllm_python`,
`run_engines_locally`, `external_server_urls`): every violation named with its fix, the
combinations not implemented yet refused by a run, and the server command lines they become."""

from __future__ import annotations

import sys

import pytest

from inflight.backends.serve_command import native_command
from inflight.backends.vllm.commands import vllm_command
from inflight.backends.vllm.venv import python_problem
from inflight.config import ConfigError, load_config
from inflight.config.implemented import require_implemented, unimplemented
from inflight.engine.config import EngineConfig
from inflight.testing import LOCAL_CPU

IE = "generator.inference_engine."
EXTERNAL = [f"{IE}run_engines_locally=false", f"{IE}external_server_urls=[http://10.0.0.5:8000]",
            f"{IE}weight_sync_backend=inprocess"]
VLLM = [f"{IE}backend=vllm", f"{IE}weight_sync_backend=inprocess"]
SHM = f"{IE}weight_sync_backend=shm"
SIDE_BY_SIDE = ["trainer.placement.colocate_all=false"]
"""SkyRL's defaults but engines beside the trainer; the engine keys at their defaults, which is what
servers started elsewhere need."""


def _violations(overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*SIDE_BY_SIDE, *overrides])
    return [(v.key, v.rule) for v in err.value.violations]


def test_defaults_and_the_two_server_setups_are_valid_and_implemented():
    local_external = [
        f"{IE}run_engines_locally=false",
        f"{IE}external_server_urls=[http://127.0.0.1:8000]",
        SHM,
    ]
    for overrides in (EXTERNAL, VLLM, [*VLLM, *EXTERNAL[:2]], [VLLM[0], SHM], local_external):
        cfg = load_config(None, [*SIDE_BY_SIDE, *overrides])
        assert unimplemented(cfg) == [], overrides
    cfg = load_config(None, list(LOCAL_CPU))
    ie = cfg.generator.inference_engine
    assert (ie.backend, ie.vllm_python, ie.run_engines_locally, ie.external_server_urls) == (
        "native",
        None,
        True,
        None,
    )


def test_every_violation_of_the_server_keys_is_named():
    found = _violations([
        f"{IE}backend=vlm", f"{IE}run_engines_locally=false", f"{IE}num_engines=2",
        f"{IE}external_server_urls=[ftp://a:1,http://b:99999,http://c:1/v1,http://c:1/,http://c:1]",
    ])
    assert found[0] == (f"{IE}backend", "must be one of native, vllm, hf_generate")  # the registry's
    urls = [rule for key, rule in found if key == f"{IE}external_server_urls"]
    assert urls == ["is not an http(s)://host:port URL", "Port out of range 0-65535",
                    "has a path, query or fragment (give the server's base URL only)", "names a server twice"]
    assert (f"{IE}num_engines", f"must equal the number of {IE}external_server_urls (5) when "
            f"{IE}run_engines_locally=false") in found
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, f"{IE}run_engines_locally=false"])
    (v,) = err.value.violations
    assert v.key == f"{IE}external_server_urls" and "must list the servers" in v.rule
    assert f"{IE}run_engines_locally=true" in v.fix


def test_keys_that_would_be_ignored_are_refused():
    assert _violations([f"{IE}external_server_urls=[http://a:1]"]) == [
        (
            f"{IE}external_server_urls",
            f"is read only with {IE}run_engines_locally=false (the run starts its own engines)",
        )
    ]
    assert _violations([f"{IE}backend=native", f"{IE}vllm_python=/x/bin/python"]) == [
        (f"{IE}vllm_python", f"is read only with {IE}backend=vllm")]
    assert _violations([*VLLM, *EXTERNAL[:2], f"{IE}vllm_python=/x/bin/python"])[0][1].startswith(
        "is not used with"
    )
    assert _violations([*VLLM, f"{IE}vllm_python= "]) == [(f"{IE}vllm_python", "is empty")]


@pytest.mark.parametrize("overrides, key, rule", [
    ([*EXTERNAL[:2], SHM], f"{IE}weight_sync_backend", "shm needs the servers on this host"),
    ([*EXTERNAL[:2], f"{IE}weight_sync_backend=gloo"], f"{IE}weight_sync_host",
     "is a loopback address, which servers on other hosts cannot reach"),
    ([*VLLM, f"{IE}device=cuda", f"{IE}offload_kv_for_weight_sync=true"], f"{IE}offload_kv_for_weight_sync",
     "cannot offload vLLM's KV on CUDA: its sleep (level 1) frees the KV cache without a copy"),
    ([*VLLM, f"{IE}attention_backend=torch"], f"{IE}attention_backend", "is a native-engine setting"),
    ([*VLLM, f"{IE}num_kv_blocks=64"], f"{IE}num_kv_blocks", "is a native-engine setting"),
    ([*EXTERNAL, f"{IE}model_dtype=float32"], f"{IE}model_dtype", "cannot reach servers started elsewhere"),
    ([*EXTERNAL, f"{IE}max_num_seqs=8"], f"{IE}max_num_seqs", "cannot reach servers started elsewhere"),
])  # fmt: skip
def test_a_run_refuses_what_servers_do_not_implement(overrides, key, rule):
    cfg = load_config(None, [*SIDE_BY_SIDE, *overrides])  # valid: the schema covers it
    with pytest.raises(ConfigError) as err:
        require_implemented(cfg)
    (v,) = err.value.violations
    assert v.key == key and v.rule.startswith(rule) and v.fix


def test_offload_on_vllm_cpu_is_accepted_as_keep():
    assert unimplemented(load_config(None, [*LOCAL_CPU, *VLLM, f"{IE}offload_kv_for_weight_sync=true"])) == []


def test_skyrls_placement_and_weight_sync_run_on_vllm_servers():
    """SkyRL's defaults (vLLM, nccl, colocate_all) and gloo, into servers started here or elsewhere:
    a run implements them, and its sender is a broadcast group the servers' client hosts."""
    from inflight.orchestration.sender import ServerGroupSender, make_sender

    cfg = load_config(None, [])
    ie = cfg.generator.inference_engine
    assert (ie.backend, ie.weight_sync_backend, cfg.trainer.placement.colocate_all) == (
        "vllm",
        "broadcast",
        True,
    )
    elsewhere = [f"{IE}run_engines_locally=false", f"{IE}external_server_urls=[http://10.0.0.5:8000]",
                 f"{IE}weight_sync_host=10.0.0.1"]
    for overrides in (
        [],
        [f"{IE}weight_sync_backend=gloo", *SIDE_BY_SIDE],
        [f"{IE}backend=native", *elsewhere],
    ):
        cfg = load_config(None, overrides)
        assert unimplemented(cfg) == [], overrides
        sender = make_sender(cfg, "/nonexistent")
        assert isinstance(sender, ServerGroupSender) and sender.backend == "gloo" and sender.split_tensors
    assert make_sender(cfg, "/nonexistent").host == "10.0.0.1"  # where servers elsewhere reach the group
    assert make_sender(load_config(None, []), "/nonexistent", host="10.1.1.1").host == "10.1.1.1"  # under Ray


def test_the_vllm_command_lines_size_the_kv_cache(tiny_model_factory, monkeypatch):
    """On CPU the run sizes each engine's KV from gpu_memory_utilization (a share of the available
    memory over the engines, less the weights) and hands it to the shim as --kv-cache-memory-gib
    (vLLM's CPU KV space); vLLM gets no --gpu-memory-utilization. On CUDA vLLM sizes it itself from
    --gpu-memory-utilization (or --kv-cache-memory-bytes), with sleep mode for colocated engines."""
    from inflight.backends.vllm.commands import vllm_args
    from inflight.config.job import JobConfig
    from inflight.orchestration import engine_memory
    from inflight.orchestration.servers import server_commands

    model = tiny_model_factory("qwen2", 0)
    monkeypatch.setattr(engine_memory, "available_bytes", lambda device: 8 * 2**30)
    util = [f"{IE}kv_cache_memory_gib=null", f"{IE}gpu_memory_utilization=0.5", f"{IE}num_engines=2"]
    cfg = load_config(None, [*LOCAL_CPU, *VLLM, *util])
    commands = [c(9000 + i) for i, c in enumerate(server_commands(cfg, JobConfig(), model, 3))]
    budget = 0.5 * 8 / 2 - engine_memory.weight_bytes(model, "float32") / 2**30
    expected = min(budget, engine_memory.usable_kv_bytes(cfg.generator.inference_engine, model) / 2**30)
    for i, cmd in enumerate(commands):
        flags = cmd[cmd.index("serve") + 1:]
        assert float(flags[flags.index("--kv-cache-memory-gib") + 1]) == pytest.approx(expected)
        assert (
            flags[flags.index("--port") + 1] == str(9000 + i)
            and flags[flags.index("--weight-version") + 1] == "3"
        )
        assert "--gpu-memory-utilization" not in cmd and "--enable-sleep-mode" not in cmd
    colocated = load_config(None, [*LOCAL_CPU, *VLLM, *util, "trainer.placement.colocate_all=true",
                                   "trainer.fully_async.enabled=false"])
    assert vllm_args(colocated.generator.inference_engine, sleep_mode=True) == []  # CPU: no sleep mode to ask
    cuda = load_config(None, [*LOCAL_CPU, *VLLM, *util, f"{IE}device=cuda", f"{IE}enforce_eager=true"])
    assert vllm_args(cuda.generator.inference_engine, sleep_mode=True) == [
        "--enforce-eager", "--gpu-memory-utilization", "0.5", "--enable-sleep-mode"]
    sized = load_config(None, [*LOCAL_CPU, *VLLM, f"{IE}device=cuda", f"{IE}kv_cache_memory_gib=2"])
    assert vllm_args(sized.generator.inference_engine) == ["--kv-cache-memory-bytes", str(2 * 2**30)]
    theirs = load_config(
        None,
        [
            *LOCAL_CPU,
            *VLLM,
            f"{IE}device=cuda",
            f"{IE}engine_init_kwargs.kv_cache_memory_bytes=4096",
            f"{IE}engine_init_kwargs.enable_sleep_mode=false",
        ],
    )
    assert vllm_args(theirs.generator.inference_engine, sleep_mode=True) == [
        "--kv-cache-memory-bytes", "4096", "--no-enable-sleep-mode"]  # vLLM's own arguments decide


def test_a_missing_vllm_python_names_the_key_and_the_setup_script(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_VLLM_PYTHON", sys.executable)
    assert python_problem(None) is None  # the shim finds it ($INFLIGHT_VLLM_PYTHON, else .venv-vllm)
    assert python_problem(sys.executable) is None
    v = python_problem(str(tmp_path / "venv" / "bin" / "python"))
    assert v.key == f"{IE}vllm_python" and f"VLLM_VENV={tmp_path / 'venv'} scripts/vllm_venv.sh" in v.fix
    monkeypatch.setenv("INFLIGHT_VLLM_PYTHON", str(tmp_path / "elsewhere" / "bin" / "python"))
    v = python_problem(None)  # issue 40: the default venv was not checked (a traceback 40 s in)
    assert v.key == f"{IE}backend" and "$INFLIGHT_VLLM_PYTHON" in v.rule and "scripts/vllm_venv.sh" in v.fix


def test_the_server_command_lines():
    engine = EngineConfig(model="/m", max_model_len=64, enable_prefix_caching=False, seed=3, weight_version=2)
    cmd = vllm_command(engine, 8123, threads=2, python="/v/bin/python")
    assert cmd[:4] == [sys.executable, "-m", "inflight.cli", "serve"]
    assert cmd[4:8] == ["--backend", "vllm", "--vllm-python", "/v/bin/python"]
    flags = " ".join(cmd[8:])
    for part in ("--model /m", "--dtype float32", "--max-model-len 64", "--no-prefix-caching", "--seed 3",
                 "--weight-version 2", "--threads 2", "--host 127.0.0.1 --port 8123"):
        assert part in flags
    assert "--vllm-python" not in vllm_command(engine, 1)
    native = native_command(EngineConfig(model="/m", num_kv_blocks=16), 9)
    assert "--backend" not in native and "--num-kv-blocks 16" in " ".join(native)
    with pytest.raises(ValueError, match="has no flag for \\['attention_backend'\\]"):
        native_command(EngineConfig(model="/m", attention_backend="torch"), 9)


def test_every_server_flag_exists_in_inflight_serve():
    """The native server's parser accepts every flag the launcher passes (the vLLM shim shares them)."""
    from inflight.server.main import build_parser

    cmd = native_command(
        EngineConfig(model="/m", num_kv_blocks=16, max_model_len=64, enable_prefix_caching=False), 9
    )
    args = build_parser().parse_args(cmd[4:])
    assert (args.model, args.num_kv_blocks, args.max_model_len, args.no_prefix_caching, args.port) == (
        "/m",
        16,
        64,
        True,
        9,
    )


def test_a_vllm_run_with_a_missing_python_starts_nothing(tmp_path):
    import asyncio

    from inflight.config.job import JobConfig
    from inflight.orchestration.servers import start_servers

    cfg = load_config(None, [*LOCAL_CPU, *VLLM, f"{IE}vllm_python={tmp_path}/venv/bin/python"])
    with pytest.raises(ConfigError, match="scripts/vllm_venv.sh"):
        asyncio.run(start_servers(cfg, JobConfig(output_dir=str(tmp_path)), tmp_path, 0))
    assert not (tmp_path / "servers").exists()


def test_inflight_train_refuses_a_missing_vllm_python_before_any_warm_up(tmp_path, capsys):
    from inflight.train.main import main

    assert (
        main(
            [
                *LOCAL_CPU,
                *VLLM,
                f"{IE}vllm_python={tmp_path}/venv/bin/python",
                f"job.output_dir={tmp_path}/run",
                "job.task=addition",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"{IE}vllm_python=" in err and "scripts/vllm_venv.sh" in err
    assert not (tmp_path / "run").exists()  # no base model built, nothing started


def test_the_demo_job_runs_on_vllm_by_one_key():
    """`inflight train --config examples/default.yaml generator.inference_engine.backend=vllm`: the demo's
    shm means chunk files in /dev/shm for the servers, which a run implements (no second key)."""
    from pathlib import Path

    from inflight.orchestration.sender import make_sender
    from inflight.train.main import resolve_config
    from inflight.weight_sync.inprocess import InProcessTransport

    demo = Path(__file__).resolve().parents[2] / "examples" / "default.yaml"
    cfg, _ = resolve_config(str(demo), [VLLM[0]])
    assert cfg.generator.inference_engine.weight_sync_backend == "shm" and unimplemented(cfg) == []
    assert isinstance(make_sender(cfg, "/nonexistent"), InProcessTransport)  # chunks go through the client
