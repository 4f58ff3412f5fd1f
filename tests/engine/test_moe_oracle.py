"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE) against transformers, and the routing record.

Oracles: transformers' `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` (greedy `generate`, and its
logits fed to the engine's own sampling rule for seeded sampling), its routers' top-k outputs
observed with forward hooks on `mlp.gate` (over one `DynamicCache`, so the KV a position attends to
can come from other weights, as after a `keep` update), and `peft` for LoRA on experts. Logprobs are
compared within a small multiple of what transformers itself moves by on the same tokens
(`tests/tolerance.py`: float64, another thread count, a full forward instead of the cached decode).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
from functools import cache

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerance import assert_close_to_reference, other_thread_count
from transformers import AutoModelForCausalLM, DynamicCache

from inflight.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams, WeightUpdateError
from inflight.engine.routing import decode_routed_experts, encode_routed_experts
from inflight.engine.sampler import sample
from inflight.engine.weight_copy import WeightPiece
from inflight.testing import make_tiny_model
from inflight.testing.oracle import hf_greedy

# Qwen3-MoE: MoE layers 0 and 2 (layer 1 dense via mlp_only_layers); Qwen2-MoE: MoE layers 1 and 3
# (decoder_sparse_step=2), each with the gated shared expert
ARCHS = {"qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),
         "qwen2_moe": dict(num_hidden_layers=4, decoder_sparse_step=2)}
PROMPTS = [[7], [5, 9, 200, 31, 8, 77, 150], list(range(40, 56)), [(13 * i) % 370 + 3 for i in range(33)]]
MAX_TOKENS = 12
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=40, seed=1234, ignore_eos=True,
                        return_routed_experts=True)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """moe(arch, seed=0) -> (model dir, transformers model in float32), built once."""
    built: dict[tuple[str, int], tuple] = {}

    def get(arch: str, seed: int = 0):
        if (arch, seed) not in built:
            path = make_tiny_model(tmp_path_factory.mktemp(f"{arch}-{seed}"), arch, seed, **ARCHS[arch])
            built[arch, seed] = path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return built[arch, seed]

    return get


@torch.no_grad()
def hf_routes(segments: list[tuple[torch.nn.Module, list[int]]]) -> np.ndarray:
    """The experts transformers' routers choose for each token, [tokens, MoE layers, top_k]: each
    (model, tokens) segment runs in turn over one KV cache (a segment attends to the earlier ones' KV)."""
    kv, rows = None, []
    for model, tokens in segments:
        seen: list[torch.Tensor] = []
        gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
        hooks = [g.register_forward_hook(lambda m, i, out, seen=seen: seen.append(out[2])) for g in gates]
        try:
            kv = kv or DynamicCache(config=model.config)
            model(torch.tensor([tokens]), cache=kv, use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        rows.append(torch.stack(seen, dim=1).numpy())
    return np.concatenate(rows)


@cache
def _hf_logits(model: torch.nn.Module, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_seeded(
    model, prompt: list[int], tokens: list[int], params: SamplingParams
) -> tuple[list[int], list[float]]:
    """The engine's sampling rule (`sampler.sample`, a generator seeded as the request's) over
    transformers' logits of the sequence the engine produced: what each step would have drawn."""
    logits = _hf_logits(model, tuple(prompt + tokens))
    gen = torch.Generator().manual_seed(params.seed)
    out, lps = [], []
    for step in range(len(tokens)):
        token, lp, _ = sample(logits[len(prompt) - 1 + step][None], [params], [gen], torch.Generator())
        out.append(token[0])
        lps.append(lp[0])
    return out, lps


@cache
def _hf_greedy_refs(model: torch.nn.Module) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def check_against_hf(hf, outputs, seeded_outputs=()) -> None:
    """Greedy tokens equal, seeded samples equal, logprobs within what transformers itself varies by
    on these tokens, and every recorded routing equal to transformers' routers over the same tokens."""
    greedy_refs = _hf_greedy_refs(hf)
    for prompt, out, (tokens, _) in zip(PROMPTS, outputs, greedy_refs, strict=True):
        assert out.output_token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        check_routing(hf, prompt, out)
    # one tolerance over every prompt: the reference's spread on a whole set, not on each few tokens
    _check_logprobs(hf, [(p, t, lps) for p, (t, lps) in zip(PROMPTS, greedy_refs, strict=True)],
                    outputs, "greedy logprobs")
    seeded = []
    for prompt, out in zip(PROMPTS if seeded_outputs else [], seeded_outputs, strict=True):
        tokens, logprobs = hf_seeded(hf, prompt, out.output_token_ids, SEEDED)
        assert out.output_token_ids == tokens
        check_routing(hf, prompt, out)
        seeded.append((prompt, tokens, logprobs))
    if seeded:
        _check_logprobs(hf, seeded, seeded_outputs, "seeded logprobs")


def _check_logprobs(hf, refs: list[tuple[list[int], list[int], list[float]]], outputs, what: str) -> None:
    """The engine's logprobs against transformers' (`refs`: prompt, tokens, logprobs), within what
    transformers' own logprobs of those tokens move by in float64, on another thread count and as
    one full forward."""
    wide = _hf_float64(hf)
    with other_thread_count():
        threads = [_teacher_forced(hf, prompt, tokens) for prompt, tokens, _ in refs]
    variants = [np.concatenate(v) for v in ([_teacher_forced(wide, p, t) for p, t, _ in refs], threads,
                                            [_teacher_forced(hf, p, t) for p, t, _ in refs])]
    assert_close_to_reference(np.concatenate([out.logprobs for out in outputs]),
                              np.concatenate([lps for _, _, lps in refs]), variants, what)


@torch.no_grad()
def _teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """`model`'s logprob of each of `tokens` after `prompt`, from one forward over both."""
    logprobs = model(torch.tensor([prompt + tokens])).logits[0].double().log_softmax(-1)
    return logprobs[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0].numpy()


@cache
def _hf_float64(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in float64 (transformers' grouped-matmul experts take no float64: its eager ones)."""
    wide = copy.deepcopy(model).double()
    wide.set_experts_implementation("eager")
    return wide


def check_routing(hf, prompt: list[int], out) -> None:
    full = prompt + out.output_token_ids
    record = out.routed_experts
    assert record.dtype == np.uint8 and record.shape[1:] == (2, 2)
    assert out.routed_experts_start + len(record) == len(full) - 1  # every position with KV
    expected = hf_routes([(hf, full[:-1])])[out.routed_experts_start :]
    np.testing.assert_array_equal(record, expected)


@pytest.mark.skipif(os.environ.get("INFLIGHT_NATIVE_KERNELS") == "0", reason="INFLIGHT_NATIVE_KERNELS=0")
@pytest.mark.parametrize("arch", ARCHS)
def test_native_paths_match_transformers_at_every_isa_level(arch, kernel_isa, moe):
    """Greedy and seeded requests in one batch, chunked prefill beside decodes (budget 24 tokens),
    the fused kernels and packed matmuls at each kernel ISA level the CPU runs."""
    model_dir, hf = moe(arch)
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, max_num_batched_tokens=24,
                                    attention_backend="native", elementwise_backend="native",
                                    linear_backend="onednn"))  # fmt: skip
    params = [greedy(return_routed_experts=i % 2 == 0) for i in range(len(PROMPTS))] + [SEEDED] * len(PROMPTS)
    outputs = engine.generate(PROMPTS + PROMPTS, params)
    check_against_hf(hf, outputs[: len(PROMPTS)], outputs[len(PROMPTS) :])
    starts = [out.routed_experts_start for out in outputs[: len(PROMPTS)]]
    assert starts == [0 if i % 2 == 0 else len(p) - 1 for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_paths_match_transformers(arch, moe):
    model_dir, hf = moe(arch)
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=8, attention_backend="torch",
                                    elementwise_backend="torch", linear_backend="torch"))
    check_against_hf(hf, engine.generate(PROMPTS, greedy(return_routed_experts=True)))


def test_prefix_hits_and_preemption_keep_outputs_and_routing(moe):
    """A prompt served from the prefix cache gets the routing of the request that computed those
    blocks; requests preempted by recompute get the routing of the recomputation."""
    model_dir, hf = moe("qwen2_moe")
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=13))
    first = engine.generate(PROMPTS, greedy(return_routed_experts=True))
    assert engine.stats.preemptions > 0
    again = engine.generate(PROMPTS[2:], greedy(return_routed_experts=True))
    assert all(out.num_cached_tokens > 0 for out in again)
    check_against_hf(hf, first)
    for a, b in zip(first[2:], again, strict=True):
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_agrees_with_transformers(arch, kernel_isa, moe):
    """bf16 engine against bf16 transformers: the first token's logprob within 0.1 and (nearly)
    the top one; the prompt's routing mostly the same (a near-tie may go the other way)."""
    model_dir, _ = moe(arch)
    hf = _hf_bf16(str(model_dir))
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", block_size=8))
    outputs = engine.generate(PROMPTS[1:], greedy(1, return_routed_experts=True))
    agree = total = 0
    for prompt, out in zip(PROMPTS[1:], outputs, strict=True):
        with torch.no_grad():
            logprobs = hf(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        assert abs(out.logprobs[0] - logprobs[out.output_token_ids[0]].item()) < 0.1
        assert logprobs[out.output_token_ids[0]] > logprobs.max() - 0.1
        expected = hf_routes([(hf, prompt)])
        agree += (np.sort(out.routed_experts, -1) == np.sort(expected, -1)).all(-1).sum()
        total += expected.shape[0] * expected.shape[1]
    assert agree >= 0.9 * total


@cache
def _hf_bf16(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def test_checkpoint_with_fused_expert_tensors_loads(moe, tmp_path):
    """transformers 5's own parameter names (3-D `experts.gate_up_proj` / `down_proj`, what
    `state_dict()` holds) load as well as the per-expert names `save_pretrained` writes."""
    model_dir, hf = moe("qwen3_moe")
    assert any(".experts.0.gate_proj.weight" in k for k in load_file(str(model_dir / "model.safetensors")))
    for file in model_dir.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=8))
    check_against_hf(hf, engine.generate(PROMPTS, greedy(return_routed_experts=True)))


def _update(engine: LLMEngine, chunks: list[list[tuple[str, object]]]) -> int:
    engine.begin_weight_update()
    for chunk in chunks:
        engine.load_weights(chunk)
    return engine.finish_weight_update()


def _pieces(weights: dict[str, torch.Tensor], size: int) -> list[list[tuple[str, WeightPiece]]]:
    """Each weight as WeightPieces of `size` elements, one chunk per piece (as a small transport buffer)."""
    chunks = []
    for name, tensor in sorted(weights.items()):
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), size):
            chunks.append([(name, WeightPiece(flat[start : start + size], start, tuple(tensor.shape)))])
    return chunks


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_updates_by_trainer_names_and_rollback(arch, moe):
    """The trainer's `state_dict()` names (fused experts), whole and as pieces whose ranges cross
    expert boundaries, and the checkpoint's per-expert names; an aborted update rolls back."""
    (dir_a, hf_a), (_, hf_b) = moe(arch), moe(arch, seed=1)
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=8))
    trainer_b = dict(hf_b.state_dict())
    items = sorted(trainer_b.items())
    assert _update(engine, [items[0::2], items[1::2]]) == 1
    check_against_hf(hf_b, engine.generate(PROMPTS, greedy(return_routed_experts=True)))
    per_expert_a = load_file(str(dir_a / "model.safetensors"))
    _update(engine, [sorted(per_expert_a.items())])
    check_against_hf(hf_a, engine.generate(PROMPTS, greedy(return_routed_experts=True)))
    fused = {k: v for k, v in trainer_b.items() if ".experts." in k}
    rest = sorted((k, v) for k, v in trainer_b.items() if k not in fused)
    assert _update(engine, [rest, *_pieces(fused, 1000)]) == 3
    engine.begin_weight_update()
    engine.load_weights(sorted(per_expert_a.items())[::2])
    assert engine.abort_weight_update() is True
    check_against_hf(hf_b, engine.generate(PROMPTS, greedy(return_routed_experts=True)))


@pytest.mark.parametrize("fate", ["keep", "recompute"])
def test_routing_across_an_update_is_of_the_kv_attended_to(fate, moe):
    """keep: positions computed before the update keep the old weights' routing, the rest is the new
    weights' over that KV; recompute: every position is the new weights' (the KV recomputed)."""
    (dir_a, hf_a), (_, hf_b) = moe("qwen3_moe"), moe("qwen3_moe", seed=1)
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    prompt = PROMPTS[3]
    engine.add_request("r", prompt, greedy(return_routed_experts=True))
    for _ in range(5):
        engine.step()
    engine.pause("keep")
    request = engine.requests["r"]
    cached, so_far = request.num_computed_tokens, list(request.token_ids)
    assert len(so_far) > len(prompt)
    if fate == "recompute":
        engine.reset_prefix_cache(reset_running_requests=True)
    _update(engine, [sorted(hf_b.state_dict().items())])
    engine.resume()
    (out,) = [o for _ in range(100) for o in engine.step()][:1]
    full = prompt + out.output_token_ids
    kept = hf_routes([(hf_a, full[:cached]), (hf_b, full[cached:-1])])
    recomputed = hf_routes([(hf_b, full[:-1])])
    assert not np.array_equal(kept, recomputed)  # the two fates are told apart
    np.testing.assert_array_equal(out.routed_experts, kept if fate == "keep" else recomputed)
    assert full[: len(so_far)] == so_far
    assert out.token_weight_versions[: len(so_far) - len(prompt)] == [0] * (len(so_far) - len(prompt))


def test_lora_on_attention_and_experts_equals_peft(moe):
    """peft's LoRA on attention (target_modules) and on the 3-D expert weights (target_parameters),
    sent in peft's layout under the HF names: the engine equals the merged peft model."""
    peft = pytest.importorskip("peft")
    model_dir, hf = moe("qwen3_moe")
    torch.manual_seed(3)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.lora_B["default"].weight.data.normal_(0, 0.3)
            hf_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if getattr(module, "parameter_name", None):
                hf_name += "." + module.parameter_name
            tensors[f"{hf_name}.lora_A.weight"] = module.lora_A["default"].weight.detach().clone()
            tensors[f"{hf_name}.lora_B.weight"] = (
                module.lora_B["default"].weight.detach() * module.scaling["default"]
            )
    assert "model.layers.0.mlp.experts.gate_up_proj.lora_A.weight" in tensors
    merged = model.merge_and_unload().eval()
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=8))
    _update(engine, [sorted(tensors.items())])
    outputs = engine.generate(PROMPTS, greedy(return_routed_experts=True))
    assert [o.output_token_ids for o in outputs] != [t for t, _ in _hf_greedy_refs(hf)]
    refs = []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        tokens, logprobs = hf_greedy(merged, prompt, MAX_TOKENS)
        assert out.output_token_ids == tokens
        check_routing(merged, prompt, out)
        refs.append((prompt, tokens, logprobs))
    _check_logprobs(merged, refs, outputs, "logprobs after the LoRA update")


@pytest.mark.parametrize(
    "name, tensor, needle",
    [
        (
            "model.layers.0.mlp.experts.gate_up_proj",
            torch.zeros(8, 64, 63),
            r"has shape \(8, 64, 63\), expected",
        ),
        ("model.layers.1.mlp.experts.down_proj", torch.zeros(8, 64, 32), "has no MoE layer"),
        (
            "model.layers.0.mlp.experts.down_proj.lora_A.weight",
            torch.zeros(12, 32),
            r"expected \[8 \* rank, 32\]",
        ),
        ("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(32, 64), "unknown parameter"),
    ],
    ids=["shape", "dense-layer", "lora-shape", "no-such-expert"],
)
def test_bad_expert_tensors_are_refused_by_name(name, tensor, needle, moe):
    engine = LLMEngine(EngineConfig(model=str(moe("qwen3_moe")[0]), block_size=8))
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match=needle):
        engine.load_weights([(name, tensor)])
    assert engine.abort_weight_update() is True


def test_dense_models_have_no_routing_and_refuse_to_return_it(tiny_model_factory):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=8))
    assert engine.generate([[5, 6]], greedy(2))[0].routed_experts is None
    with pytest.raises(
        InvalidRequestError, match="return_routed_experts=True: Qwen2ForCausalLM has no mixture"
    ):
        engine.add_request("x", [5, 6], greedy(2, return_routed_experts=True))
    with pytest.raises(InvalidRequestError, match="return_routed_experts="):
        engine.add_request("y", [5, 6], greedy(2, return_routed_experts=1))


def test_the_record_travels_compactly(moe):
    """Pickled (process pipe, Ray) as raw bytes; as JSON (HTTP token route) in base64, both back equal."""
    engine = LLMEngine(EngineConfig(model=str(moe("qwen2_moe")[0]), block_size=8))
    out = engine.generate([PROMPTS[3]], greedy(return_routed_experts=True))[0]
    bare = dataclasses.replace(out, routed_experts=None)
    assert len(pickle.dumps(out)) - len(pickle.dumps(bare)) < out.routed_experts.nbytes + 200
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(out)).routed_experts, out.routed_experts)
    record, start = decode_routed_experts(encode_routed_experts(out.routed_experts, out.routed_experts_start))
    assert start == out.routed_experts_start == 0 and record.dtype == np.uint8
    np.testing.assert_array_equal(record, out.routed_experts)
    wide = np.arange(3 * 2 * 2, dtype=np.uint16).reshape(3, 2, 2) * 1000
    np.testing.assert_array_equal(decode_routed_experts(encode_routed_experts(wide, 5))[0], wide)
    assert decode_routed_experts(None) == (None, 0)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_routed_experts({**encode_routed_experts(wide, 5), "shape": [4, 2, 2]})
