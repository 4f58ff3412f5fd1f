"""The engine benchmark runs end to end in its smallest form and reports sane fields (no timing checks)."""

import json

import pytest

from inflight.bench.engine_bench import main


def test_engine_bench_small(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = (
        "--small --requests 4 --min-len 4 --max-len 10 --repeats 1 --max-rounds 1 "
        "--hf-batch-sizes 4 --threads 1"
    ).split()
    argv += ["--out", str(out), "--allow-noisy", "--block-size", "8"]  # a shared test machine is rarely quiet
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "KV block size 8 on every side" in printed
    result = json.loads(out.read_text())
    engine, hf = result["engine"], result["transformers"]
    expected = result["workload"]["output_tokens"]
    assert engine["output_tokens"] == hf["output_tokens"] == expected
    assert hf["generated_tokens"] >= expected
    for side in (engine, hf):
        for key in ("median_s", "output_tok_per_s", "flops_per_s", "fraction_of_peak", "peak_rss_mib"):
            assert side[key] > 0, key
    assert engine["startup_s"] > 0 and engine["params"] > 0 and engine["warmup_s"] > 0
    assert engine["prefix_cache_hit_tokens"] == 0 and engine["block_size"] == 8
    assert len(engine["idle_sides_cores"]) == len(engine["other_cores"]) == 1
    assert result["machine"]["matmul_peak_flops"] > 0 and result["speedup"] > 0
    assert 0.0 <= result["greedy_agreement"] <= 1.0


def test_profile_counts_the_native_kernels_and_splits_the_pass(tmp_path, capsys):
    """ctypes calls are no torch ops: unlabelled, the native kernels' time fell outside every op and
    the table showed the matmuls as if they were the whole pass."""
    from inflight.engine import kernels

    out = tmp_path / "bench.json"
    argv = (
        "--small --requests 4 --min-len 4 --max-len 10 --repeats 1 --max-rounds 1 "
        "--threads 1 --against none"
    ).split()
    assert main([*argv, "--profile", "--out", str(out), "--allow-noisy"]) == 0
    printed = capsys.readouterr().out
    profile = json.loads(out.read_text())["engine"]["profile"]
    split = profile["split_s"]
    assert set(split) == {"matmul", "attention (native)", "elementwise (native)", "other ops", "outside ops"}
    assert split["matmul"] > 0 and all(s >= 0 for s in split.values())
    if kernels.load() is not None:  # native kernels on this machine: each has its own row
        assert split["attention (native)"] > 0 and split["elementwise (native)"] > 0
        assert (
            "inflight::paged_attention_rows" in profile["table"]
            and "inflight::fused_rms_norm" in profile["table"]
        )
    assert "engine profile (one pass under torch.profiler" in printed and "attention (native)" in printed


def test_labelled_kernels_are_the_library_s_own_again_afterwards():
    from inflight.bench.engine_sides import NATIVE_KERNELS, labelled_native_kernels
    from inflight.engine import kernels

    lib = kernels.load()
    if lib is None:
        pytest.skip("native kernels unavailable here (INFLIGHT_NATIVE_KERNELS=0 or no compiler)")
    before = {name: getattr(lib, name) for name in NATIVE_KERNELS}
    with labelled_native_kernels(lib):
        assert all(getattr(lib, name) is not before[name] for name in NATIVE_KERNELS)
    assert all(getattr(lib, name) is before[name] for name in NATIVE_KERNELS)
    with labelled_native_kernels(None):  # no library (kernels off): nothing to label
        pass


def test_worker_env_is_set_from_the_start_and_not_left_behind():
    import os

    from inflight.bench.common import Worker

    assert "INFLIGHT_TEST_VAR" not in os.environ
    with Worker({"INFLIGHT_TEST_VAR": "1"}) as worker:
        assert worker.call(os.getenv, "INFLIGHT_TEST_VAR") == "1"
    assert "INFLIGHT_TEST_VAR" not in os.environ


def test_allocator_choice_preloads_tcmalloc_into_the_side_processes(monkeypatch):
    from inflight.bench import engine_bench
    from inflight.bench.common import TCMALLOC_NAMES, Worker, find_library

    assert engine_bench.side_env("system") == {}
    monkeypatch.setattr(engine_bench, "find_library", lambda names: None)
    assert engine_bench.side_env("auto") == {}
    with pytest.raises(SystemExit, match="apt-get install libtcmalloc-minimal4"):
        engine_bench.side_env("tcmalloc")
    monkeypatch.undo()
    if find_library(TCMALLOC_NAMES) is None:
        pytest.skip("tcmalloc is not installed here")
    env = engine_bench.side_env("auto")
    with Worker(env) as worker:  # loaded in the worker: its memory map names the library
        maps = worker.call(_read_maps)
    assert "libtcmalloc" in maps


def _read_maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def test_engine_bench_moe_small_counts_only_the_active_experts(tmp_path, capsys):
    """`--moe`: a Qwen3-MoE of the same trunk, its FLOPs those of the router and the experts each token
    ran (from the model's own parameters: attention + router + top_k / num_experts of the experts)."""
    from transformers import AutoModelForCausalLM

    from inflight.bench.engine_workload import BenchConfig

    out = tmp_path / "bench.json"
    argv = (
        "--moe --small --requests 4 --min-len 4 --max-len 10 --repeats 1 --max-rounds 1 "
        "--hf-batch-sizes 4"
    ).split()
    argv += ["--threads", "1", "--out", str(out), "--allow-noisy", "--model-dir", str(tmp_path / "model")]
    assert main(argv) == 0
    assert "MoE: 8 experts of 128, 2 per token" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["engine"]["output_tokens"] == result["transformers"]["output_tokens"]
    assert result["engine"]["fraction_of_peak"] > 0 and result["transformers"]["fraction_of_peak"] > 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 8
    params = dict(model.named_parameters())
    active = sum(
        p.numel() for n, p in params.items() if n.endswith("proj.weight") or n.endswith("mlp.gate.weight")
    )
    active += sum(p.numel() for n, p in params.items() if ".experts." in n) * 2 // 8
    assert BenchConfig(small=True, moe=True).shape.trunk_matmul_params() == active


def test_a_model_dir_is_benchmarked_with_its_own_shape_and_flops(tmp_path, capsys):
    """`--model-dir` of an existing model (e.g. `inflight models get`'s): a vocabulary larger than the
    built-in shape's 8,192, prompts drawn from all of it, and the header and FLOPs the model's own
    (counted here from transformers' model of the directory), not the built-in shape's."""
    from transformers import AutoModelForCausalLM

    from inflight.testing import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", "llama", vocab_size=12_000, hidden_size=64,
                                intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=True)
    out = tmp_path / "bench.json"
    argv = (
        "--requests 6 --min-len 4 --max-len 10 --repeats 1 --max-rounds 1 "
        "--hf-batch-sizes 6 --threads 1"
    ).split()
    assert main([*argv, "--model-dir", str(model_dir), "--out", str(out), "--allow-noisy"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    params = dict(hf.named_parameters())
    assert f"model: llama from {model_dir}, hidden 64, 3 layers, vocab 12000" in printed
    assert (
        f"{hf.num_parameters() / 1e6:.1f}M params" in printed
        and result["engine"]["params"] == hf.num_parameters()
    )
    assert result["config"]["shape"]["vocab_size"] == 12_000 and result["model"]["built_here"] is False
    work = result["workload"]
    trunk = sum(p.numel() for n, p in params.items() if n.endswith("proj.weight"))
    head = params["model.embed_tokens.weight"].numel()
    all_tokens = work["prompt_tokens"] + work["output_tokens"]
    assert work["flops_per_run"]["matmul"] == 2 * trunk * all_tokens + 2 * head * work["output_tokens"]
    assert (
        result["engine"]["output_tokens"] == result["transformers"]["output_tokens"] == work["output_tokens"]
    )


def test_small_or_moe_beside_an_existing_model_dir_is_refused(tmp_path, capsys):
    from inflight.testing import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", "qwen2")
    with pytest.raises(SystemExit):
        main(["--small", "--model-dir", str(model_dir)])
    assert f"--model-dir {model_dir} holds a model already" in capsys.readouterr().err
