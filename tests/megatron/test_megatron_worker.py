"""The megatron policy worker: HF <-> megatron conversion, TP=2 training on CPU, sync into an engine.

One spawn of 2 gloo ranks (tensor parallel size 2) runs every case once and saves what rank 0 saw;
the tests compare it in this process with `transformers` and with `LocalPolicyWorker` (the same
base-class training step on an unsharded transformers model) as the oracles:

- megatron's forward logits equal transformers' on the same weights;
- the HF tensors gathered from the TP shards are bit-identical to the checkpoint (HF -> megatron -> HF);
- megatron's vocab-parallel token entropy equals the entropy of transformers' logits;
- one train step (PPO loss with an entropy bonus, micro-batches, AdamW, clipping) gives the weights
  LocalPolicyWorker gets;
- the base class's `sync_weights` syncs them into a real engine with requests in
  flight (fully-async, clear KV: fate `recompute`): the frozen requests are reset, and every token
  sampled after the sync, and its logprob, is the trained model's, through transformers and through
  megatron itself.

Cases: Qwen2 (q/k/v bias, untied lm_head) and Qwen3 (qk-norm, tied embeddings, a vocabulary that TP
must pad).
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed; install the extra: pip install -e '.[megatron]'"
)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from inflight.algorithms import entropy_from_logits, masked_mean, ppo_clip_loss  # noqa: E402
from inflight.config import load_config  # noqa: E402
from inflight.megatron.convert import (  # noqa: E402
    ConversionError,
    MegatronLayout,
    hf_to_megatron_shard,
    hf_to_megatron_shards,
    megatron_to_hf,
)
from inflight.testing import (
    LOCAL_CPU,
    make_tiny_model,  # noqa: E402
)
from inflight.train import TrainBatch  # noqa: E402
from inflight.train.workers import LocalPolicyWorker  # noqa: E402

TP = 2
LR = 1e-3
SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
CASES = {
    "qwen2": dict(arch="qwen2", seed=0, tie_word_embeddings=False),
    "qwen3-tied-padded-vocab": dict(arch="qwen3", seed=1, tie_word_embeddings=True, vocab_size=381),
}
PROMPTS = {"a": [5, 17, 42, 99, 7, 250, 31], "b": [300, 12, 9, 77, 150]}
MAX_TOKENS = 8


def _cfg(model_dir: Path):
    return load_config(
        None,
        overrides=[
            *LOCAL_CPU,
            f"trainer.policy.model.path={model_dir}",
            "trainer.strategy=megatron",
            f"trainer.policy.optimizer_config.lr={LR}",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.fully_async.enabled=true",
            "trainer.fully_async.clear_kv_cache_on_weight_sync=true",
            # SkyRL's default recompute settings run megatron's activation checkpointing, which needs CUDA
            "trainer.policy.megatron_config.transformer_config_kwargs={}",
        ],
    )


def _batch(vocab: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, vocab, (3, 10), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 8:] = 0  # right padding of the last row
    loss_mask = attention_mask.clone()
    loss_mask[:, :4] = 0  # the "prompt"
    return TrainBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
        advantages=torch.tensor([1.0, -0.5, 2.0]),
    )


def ppo_with_entropy_bonus(logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor) -> torch.Tensor:
    """On-policy PPO-clip (token mean) minus 0.1 times the token-mean entropy: a loss whose gradient
    runs through the worker's log-probabilities and its entropy."""
    advantages = batch.advantages[:, None].expand_as(logprobs)
    loss, _ = ppo_clip_loss(logprobs, logprobs.detach(), advantages, batch.loss_mask)
    return masked_mean(loss, batch.loss_mask) - 0.1 * masked_mean(entropy, batch.loss_mask)


ppo_with_entropy_bonus.wants_entropy = True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- what each rank runs ------------------------------------------------------------------------
def _engine_mid_decode(model_dir: Path):
    from inflight.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            block_size=4,
            num_kv_blocks=32,
            max_num_seqs=4,
            max_model_len=64,
            seed=0,
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, params)
    while any(len(engine.get_request_output(r).output_token_ids) < 2 for r in PROMPTS):
        assert engine.step() == [], "a request finished before the sync"
    return engine


def _run_case(rank: int, model_dir: Path, out: Path) -> None:
    from inflight.client.local import LocalClient
    from inflight.engine import AsyncEngine
    from inflight.megatron.worker import MegatronPolicyWorker
    from inflight.weight_sync import plan_weight_sync

    cfg = _cfg(model_dir)
    worker = MegatronPolicyWorker(cfg, loss_fn=ppo_with_entropy_bonus, tensor_parallel_size=TP).setup()
    batch = _batch(worker.layout.vocab_size)
    result: dict = {"logits_before": worker.forward_logits(batch.input_ids)}
    with torch.no_grad():
        result["entropy"] = worker.compute_logprobs(batch, entropy=True)[1]
    result["hf_before"] = worker.full_hf_state_dict()
    result["metrics"] = worker.train_step(batch)
    result["hf_after"] = worker.full_hf_state_dict()
    result["logits_after"] = worker.forward_logits(batch.input_ids)
    plan = plan_weight_sync(cfg)
    engine = _engine_mid_decode(model_dir) if rank == 0 else None
    client = LocalClient(AsyncEngine(engine)) if rank == 0 else None
    report = asyncio.run(worker.sync_weights(client, plan, version=1))
    length = max(map(len, PROMPTS.values())) + MAX_TOKENS
    sequences = torch.zeros(len(PROMPTS), length, dtype=torch.long)
    if rank == 0:
        result["plan_steps"], result["report"] = plan.steps(), report
        result["resets"] = engine.stats.resets
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step()})
        result["engine"] = [outputs[r] for r in PROMPTS]
        for row, (prompt, o) in enumerate(zip(PROMPTS.values(), result["engine"], strict=True)):
            sequences[row, : len(prompt) + MAX_TOKENS] = torch.tensor(prompt + o.output_token_ids)
    dist.broadcast(sequences, src=0)  # megatron's forward is collective: every rank needs the tokens
    result["sequences"] = sequences
    result["logits_sequences"] = worker.forward_logits(sequences)
    worker.load_hf_tensors(result["hf_before"].items())  # e.g. a checkpoint, back into the TP shards
    result["hf_reloaded"] = worker.full_hf_state_dict()
    worker.shutdown()
    if rank == 0:
        torch.save(result, out)


def _rank_main(rank: int, world: int, port: int, cases: dict[str, tuple[Path, Path]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for model_dir, out in cases.values():
            _run_case(rank, model_dir, out)
    finally:
        dist.destroy_process_group()


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_models")
    return {
        case: make_tiny_model(
            root / case,
            arch=spec["arch"],
            seed=spec["seed"],
            **SMALL,
            **{k: v for k, v in spec.items() if k not in ("arch", "seed")},
        )
        for case, spec in CASES.items()
    }


@pytest.fixture(scope="module")
def ranks_output(model_dirs, tmp_path_factory) -> dict[str, dict]:
    """Spawn the 2 TP ranks once; per case, what rank 0 recorded."""
    out_dir = tmp_path_factory.mktemp("megatron_ranks")
    cases = {case: (path, out_dir / f"{case}.pt") for case, path in model_dirs.items()}
    mp.spawn(_rank_main, args=(TP, _free_port(), cases), nprocs=TP, join=True)
    return {case: torch.load(out, weights_only=False) for case, (_, out) in cases.items()}


def _hf(model_dir: Path, weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected
        assert set(missing) <= {"lm_head.weight"} and model.config.tie_word_embeddings == bool(missing)
    return model.eval()


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


# ---- conversion, no ranks -----------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_exact(model_dirs, case, tp):
    weights = _checkpoint(model_dirs[case])
    layout = MegatronLayout.from_hf_config(AutoConfig.from_pretrained(model_dirs[case]), tp)
    shards = [hf_to_megatron_shards(weights, layout, rank) for rank in range(tp)]
    back = dict(megatron_to_hf(shards, layout))
    expected = {
        k: v for k, v in weights.items() if not (layout.tie_word_embeddings and k == "lm_head.weight")
    }
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_and_gated_mlp_layouts():
    """Per query group [q heads; k; v], groups split across ranks; fc1 shard r is [gate_r; up_r]."""
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=4,
        intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8,
    )
    config.head_dim = 1
    layout = MegatronLayout.from_hf_config(config, tp=2)
    p = "model.layers.0."
    weights = {
        p + "self_attn.q_proj.bias": torch.tensor([10.0, 11, 12, 13]),  # query heads 0..3
        p + "self_attn.k_proj.bias": torch.tensor([20.0, 21]),  # kv heads 0, 1
        p + "self_attn.v_proj.bias": torch.tensor([30.0, 31]),
        p + "mlp.gate_proj.weight": torch.arange(4.0)[:, None].expand(4, 4) + 100,
        p + "mlp.up_proj.weight": torch.arange(4.0)[:, None].expand(4, 4) + 200,
    }
    qkv, fc1 = "decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.mlp.linear_fc1.weight"
    qkv_shards = [hf_to_megatron_shard(qkv, weights.__getitem__, layout, r) for r in (0, 1)]
    assert qkv_shards[0].tolist() == [10, 11, 20, 30] and qkv_shards[1].tolist() == [12, 13, 21, 31]
    fc1_shards = [hf_to_megatron_shard(fc1, weights.__getitem__, layout, r) for r in (0, 1)]
    assert fc1_shards[0][:, 0].tolist() == [100, 101, 200, 201]
    assert fc1_shards[1][:, 0].tolist() == [102, 103, 202, 203]


def test_unsupported_layouts_are_refused():
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=64,
    )
    with pytest.raises(ConversionError, match="num_key_value_heads=1"):
        MegatronLayout.from_hf_config(config, tp=2)


def test_tensor_parallel_size_comes_from_the_config(model_dirs):
    """trainer.policy.megatron_config.tensor_model_parallel_size sizes the worker's TP groups (what
    `make_worker` relies on); an explicit tensor_parallel_size wins."""
    from inflight.megatron.worker import MegatronPolicyWorker

    path = model_dirs["qwen2"]
    tp2 = load_config(None, [*LOCAL_CPU,
        "trainer.strategy=megatron", "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.policy.megatron_config.tensor_model_parallel_size=2",
    ])  # fmt: skip
    worker = MegatronPolicyWorker(tp2, model_path=path)
    assert worker.tp == worker.layout.tp == 2
    assert MegatronPolicyWorker(tp2, model_path=path, tensor_parallel_size=1).tp == 1
    assert MegatronPolicyWorker(load_config(None, list(LOCAL_CPU)), model_path=path).tp == 1


# ---- two TP ranks -------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_forward_matches_transformers(model_dirs, ranks_output, case):
    result = ranks_output[case]
    with torch.no_grad():
        expected = _hf(model_dirs[case])(_batch(result["logits_before"].shape[-1]).input_ids).logits
    torch.testing.assert_close(result["logits_before"], expected, atol=1e-5, rtol=0)
    batch = _batch(result["logits_before"].shape[-1])
    real = batch.attention_mask[:, :-1].bool()  # the distributions read from real tokens
    entropy = entropy_from_logits(
        expected[:, :-1] / _cfg(model_dirs[case]).generator.sampling_params.temperature
    )
    torch.testing.assert_close(result["entropy"][:, 1:][real], entropy[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_gathered_hf_tensors_equal_checkpoint(model_dirs, ranks_output, case):
    weights = _checkpoint(model_dirs[case])
    if CASES[case]["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    for key in ("hf_before", "hf_reloaded"):  # gathered after the load; after load_hf_tensors
        gathered = ranks_output[case][key]
        assert list(gathered) and set(gathered) == set(weights)
        for name, tensor in weights.items():
            assert gathered[name].dtype == tensor.dtype and torch.equal(gathered[name], tensor), (key, name)


@pytest.mark.parametrize("case", list(CASES))
def test_train_step_equals_unsharded_transformers_step(model_dirs, ranks_output, case):
    """The base class's step (PPO loss and entropy bonus, 2 micro-batches, AdamW, clip) on an
    unsharded transformers model lands on the weights megatron's TP=2 step produced."""
    result = ranks_output[case]
    reference = LocalPolicyWorker(_cfg(model_dirs[case]), loss_fn=ppo_with_entropy_bonus).setup()
    metrics = reference.train_step(_batch(reference.model.config.vocab_size))
    assert result["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
    assert result["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    trained = reference.full_hf_state_dict()
    assert set(result["hf_after"]) == set(trained) - (
        {"lm_head.weight"} if CASES[case]["tie_word_embeddings"] else set()
    )
    for name, tensor in result["hf_after"].items():
        # Adam's first step moves a weight by ~lr; float noise in near-zero gradients moves it by less
        torch.testing.assert_close(tensor, trained[name], atol=LR * 0.05, rtol=0, msg=name)
    changed = [
        n for n in result["hf_after"] if not torch.equal(result["hf_after"][n], result["hf_before"][n])
    ]
    assert len(changed) == len(result["hf_after"])


@pytest.mark.parametrize("case", list(CASES))
def test_engine_after_sync_matches_trained_model(model_dirs, ranks_output, case):
    result = ranks_output[case]
    report = result["report"]
    assert report.ok and report.version == 1 and report.steps == result["plan_steps"]
    assert result["resets"] == len(PROMPTS)  # fate recompute: the frozen requests were reset
    # the step changed the model: a sync that did nothing would not pass the checks below
    assert (result["logits_after"] - result["logits_before"]).abs().max() > 1e-2
    trained_hf = _hf(model_dirs[case], result["hf_after"])
    with torch.no_grad():
        new_logits = trained_hf(result["sequences"]).logits
        old_logits = _hf(model_dirs[case])(result["sequences"]).logits
        batch_logits = trained_hf(_batch(new_logits.shape[-1]).input_ids).logits
    # the trained megatron model, re-read through transformers
    torch.testing.assert_close(result["logits_after"], batch_logits, atol=1e-5, rtol=0)
    for row, (prompt, output) in enumerate(zip(PROMPTS.values(), result["engine"], strict=True)):
        versions = output.token_weight_versions
        assert versions[:2] == [0, 0] and versions[-1] == 1 and versions == sorted(versions)
        for k, (token, logprob, version) in enumerate(
            zip(output.output_token_ids, output.logprobs, versions, strict=True)
        ):
            position = len(prompt) + k - 1
            # recompute: after the sync the whole sequence so far is re-read by the trained model,
            # so teacher forcing the final sequence is the oracle (megatron's own forward as well)
            references = (new_logits, result["logits_sequences"]) if version == 1 else (old_logits,)
            for logits in references:
                step = logits[row, position]
                assert int(step.argmax()) == token, (case, row, k, version)
                assert logprob == pytest.approx(float(torch.log_softmax(step, -1)[token]), abs=1e-4)


def test_skyrls_default_recompute_is_refused_on_cpu_naming_the_key(tmp_path):
    from inflight.config import ConfigError
    from inflight.megatron.worker import MegatronPolicyWorker
    from inflight.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "m", arch="qwen2")
    cfg = load_config(None, [*LOCAL_CPU, f"trainer.policy.model.path={model}", "trainer.strategy=megatron",
                             "trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=full"])
    with pytest.raises(ConfigError) as err:
        MegatronPolicyWorker(cfg, device="cpu")
    key = "trainer.policy.megatron_config.transformer_config_kwargs"
    assert err.value.keys == [key] and "CUDA only" in str(err.value) and f"{key}={{}}" in str(err.value)
