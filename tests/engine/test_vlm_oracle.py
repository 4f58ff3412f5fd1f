"""Qwen2.5-VL and Qwen3-VL in the native engine against transformers' `Qwen2_5_VLForConditionalGeneration`
and `Qwen3VLForConditionalGeneration` on tiny random models (every test runs for both; Qwen3-VL's
DeepStack, interleaved M-RoPE and q/k norms included): M-RoPE positions, greedy tokens and logprobs for
prompts with 0, 1 and 3 images of different sizes (batched together, whole or chunked prefill with
preemption, prefix-cache hits), prefix-cache keys that hold the images, a keep-pause weight update,
and refused inputs."""

from __future__ import annotations

import asyncio
import copy
from functools import cache

import numpy as np
import pytest
import torch
from PIL import Image
from tolerance import assert_close_to_reference, other_thread_count
from transformers import DynamicCache

from inflight.engine import AsyncEngine, EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from inflight.engine.multimodal import MultimodalInput
from inflight.testing.tiny_vlm import TINY_VLMS, load_tiny_processor

MAX_TOKENS = 12
# (width, height) of each image: 6; 4, 12 and 10 placeholders at the tiny Qwen2.5-VL processor's sizes
# (14-pixel patches), 6; 4, 12 and 8 at Qwen3-VL's (16-pixel)
SIZES = {0: [], 1: [(84, 56)], 3: [(56, 56), (112, 84), (70, 140)]}


@pytest.fixture(scope="module", params=sorted(TINY_VLMS))
def vlm(request, tmp_path_factory):
    """Model A (seed 0) and model B (seed 1) directories, their transformers twins, the processor."""
    build, hf_class = TINY_VLMS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    dir_a, dir_b = build(root / "a", seed=0), build(root / "b", seed=1)
    hf = [hf_class.from_pretrained(d, dtype=torch.float32).eval() for d in (dir_a, dir_b)]
    return dir_a, dir_b, hf[0], hf[1], load_tiny_processor(dir_a)


def _image(size: tuple[int, int], seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _inputs(processor, images: list[Image.Image], text: str = "count the shapes 3+4") -> dict:
    """The processor's output for one user turn with `images` then `text`."""
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(processor(text=[rendered], images=images or None, return_tensors="pt"))


def _mm(inputs: dict) -> MultimodalInput | None:
    if "pixel_values" not in inputs:
        return None
    return MultimodalInput(inputs["pixel_values"], inputs["image_grid_thw"])


def _ids(inputs: dict) -> list[int]:
    return inputs["input_ids"][0].tolist()


def _cases(processor) -> list[dict]:
    return [_inputs(processor, [_image(s, 10 * n + i) for i, s in enumerate(SIZES[n])]) for n in (0, 1, 3)]


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def _hf_generate(hf, inputs: dict, max_new: int = MAX_TOKENS) -> tuple[list[int], list[float]]:
    """transformers' greedy generate() (EOS ignored): the new tokens and their logprobs."""
    out = hf.generate(
        **inputs,
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [
        torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens, strict=True)
    ]


@torch.no_grad()
def _hf_teacher_forced(hf, inputs: dict, tokens: list[int]) -> np.ndarray:
    """transformers' logprob of each of `tokens` after the prompt: one forward over the prompt and its
    images, one over the tokens (a sampled placeholder token is then text, as in generate())."""
    dtype = next(hf.parameters()).dtype
    positions = _positions(hf, inputs, len(tokens))
    prompt_len = inputs["input_ids"].shape[1]
    images = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    images = dict(images, pixel_values=images["pixel_values"].to(dtype)) if images else {}
    cache_ = DynamicCache(config=hf.config)
    first = hf(
        input_ids=inputs["input_ids"],
        position_ids=positions[..., :prompt_len],
        cache=cache_,
        use_cache=True,
        **images,
    ).logits[0, -1:]
    rest = hf(input_ids=torch.tensor([tokens[:-1]]), position_ids=positions[..., prompt_len:-1], cache=cache_,
              use_cache=True).logits[0]
    logprobs = torch.cat((first, rest)).double().log_softmax(-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()


def _positions(hf, inputs: dict, new: int) -> torch.Tensor:
    """[3, 1, prompt + new] positions: transformers' get_rope_index of the prompt, then its delta."""
    prompt_len = inputs["input_ids"].shape[1]
    positions, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               inputs.get("image_grid_thw"))
    tail = (torch.arange(prompt_len, prompt_len + new) + delta).view(1, 1, -1).expand(3, 1, -1)
    return torch.cat((positions, tail), dim=2)


@cache
def _float64(hf):
    return copy.deepcopy(hf).double()


def _check_against_hf(hf, cases: list[dict], outputs) -> None:
    """Greedy tokens equal transformers' generate(); logprobs within what transformers itself moves
    by on these tokens (float64, another thread count, one full forward)."""
    refs = [_hf_generate(hf, inputs) for inputs in cases]
    for inputs, out, (tokens, _) in zip(cases, outputs, refs, strict=True):
        assert out.prompt_token_ids == _ids(inputs)
        assert out.output_token_ids == tokens, (
            f"a prompt with {len(inputs.get('image_grid_thw', []))} images diverged"
        )
    with other_thread_count():
        threads = [_hf_generate(hf, inputs)[1] for inputs in cases]
    variants = [
        np.concatenate(v)
        for v in (
            threads,
            [
                _hf_teacher_forced(_float64(hf), inputs, tokens)
                for inputs, (tokens, _) in zip(cases, refs, strict=True)
            ],
            [_hf_teacher_forced(hf, inputs, tokens) for inputs, (tokens, _) in zip(cases, refs, strict=True)],
        )
    ]
    assert_close_to_reference(np.concatenate([out.logprobs for out in outputs]),
                              np.concatenate([lps for _, lps in refs]), variants, "greedy logprobs")


def test_mrope_positions_equal_transformers(vlm):
    """The positions planned at admission are transformers' get_rope_index, and so is the delta
    that continues them for the sampled tokens."""
    dir_a, _, hf, _, processor = vlm
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    for inputs in _cases(processor)[1:]:
        engine.add_request("r", _ids(inputs), _greedy(1), multimodal=_mm(inputs))
        plan = engine.requests["r"].images
        positions, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   inputs["image_grid_thw"])
        assert torch.equal(plan.positions, positions[:, 0]) and plan.delta == int(delta)
        assert plan.delta < 0  # the images take fewer positions than placeholders
        engine.abort(["r"])


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-preempting"])
def test_greedy_with_0_1_3_images_matches_transformers(vlm, chunked):
    """The three prompts in one batch; chunked: 7-token chunks cut through the image placeholders and
    11 KV blocks of 4 make the longest request preempt the others (images encoded again)."""
    dir_a, _, hf, _, processor = vlm
    cases = _cases(processor)
    extra = (
        dict(max_num_batched_tokens=7, num_kv_blocks=max(len(_ids(c)) for c in cases) // 4 + 4)
        if chunked
        else {}
    )
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4, enable_prefix_caching=False, **extra))
    outputs = engine.generate([_ids(c) for c in cases], _greedy(), multimodal=[_mm(c) for c in cases])
    if chunked:
        assert engine.stats.preemptions > 0
    _check_against_hf(hf, cases, outputs)


def test_prefix_cache_hits_with_images_match_transformers(vlm):
    """A repeat hits its image blocks; a prompt with the same first image and another second one
    hits only the blocks before the second image; every output equals transformers'."""
    dir_a, _, hf, _, processor = vlm
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    images = [_image(s, 30 + i) for i, s in enumerate(SIZES[3])]
    first = _inputs(processor, images)
    other = _inputs(processor, [images[0], _image(SIZES[3][1], 99), images[2]])
    assert _ids(first) == _ids(other)
    outs = [engine.generate([_ids(c)], _greedy(), multimodal=[_mm(c)])[0] for c in (first, first, other)]
    spans = _runs(_ids(first), engine.vision.image_token_id)
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens >= spans[-1][1] - 4  # every image's blocks came from the cache
    assert outs[2].num_cached_tokens == spans[1][0] // 4 * 4  # up to the block of the changed image
    _check_against_hf(hf, [first, first, other], outs)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    where = [i for i, t in enumerate(ids) if t == token]
    runs = [[where[0], where[0] + 1]]
    for i in where[1:]:
        if i == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    return [tuple(r) for r in runs]


def test_prompts_differing_only_in_an_image_never_share_kv(vlm):
    """Same token ids, another image: nothing past the text before the image comes from the cache,
    with the engine's pixel hashes or the caller's; the caller's hash is the key (a repeat with the
    same hash and grid shares)."""
    dir_a, _, hf, _, processor = vlm
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    a, b = (_inputs(processor, [_image((84, 56), seed)]) for seed in (1, 2))
    assert _ids(a) == _ids(b) and torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    start = _runs(_ids(a), engine.vision.image_token_id)[0][0]
    out_a = engine.generate([_ids(a)], _greedy(), multimodal=[_mm(a)])[0]
    out_b = engine.generate([_ids(b)], _greedy(), multimodal=[_mm(b)])[0]
    assert out_b.num_cached_tokens == start // 4 * 4
    _check_against_hf(hf, [a, b], [out_a, out_b])
    assert out_a.output_token_ids != out_b.output_token_ids, "the image does not matter here; pick others"
    hashed = [
        MultimodalInput(c["pixel_values"], c["image_grid_thw"], (name,)) for c, name in ((a, "x"), (b, "y"))
    ]
    engine.generate([_ids(a)], _greedy(), multimodal=[hashed[0]])
    assert (
        engine.generate([_ids(b)], _greedy(), multimodal=[hashed[1]])[0].num_cached_tokens == start // 4 * 4
    )
    again = engine.generate([_ids(a)], _greedy(), multimodal=[hashed[0]])[0]
    assert again.num_cached_tokens > start and again.output_token_ids == out_a.output_token_ids


@torch.no_grad()
def _hf_continue(kv_model, model, inputs: dict, seq: list[int], num_cached: int, max_new: int) -> list[int]:
    """`kv_model` computes the KV of seq[:num_cached] (the prompt's images included), `model` reads
    the rest over it and decodes greedily; positions from transformers' get_rope_index."""
    prompt_len = inputs["input_ids"].shape[1]
    positions = _positions(kv_model, inputs, len(seq) + max_new - prompt_len)
    cache_ = DynamicCache(config=model.config)
    images = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    if num_cached:
        kv_model(
            input_ids=torch.tensor([seq[:num_cached]]),
            position_ids=positions[..., :num_cached],
            cache=cache_,
            use_cache=True,
            **(images if num_cached >= prompt_len else {}),
        )
    rest = {} if num_cached else images
    logits = model(
        input_ids=torch.tensor([seq[num_cached:]]),
        position_ids=positions[..., num_cached : len(seq)],
        cache=cache_,
        use_cache=True,
        **rest,
    ).logits
    out: list[int] = []
    while len(out) < max_new:
        out.append(int(logits[0, -1].argmax()))
        p = len(seq) + len(out) - 1
        logits = model(
            input_ids=torch.tensor([[out[-1]]]),
            position_ids=positions[..., p : p + 1],
            cache=cache_,
            use_cache=True,
        ).logits
    return out


@pytest.mark.parametrize("fate", ["keep", "recompute"])
def test_keep_pause_weight_update_with_images(vlm, fate):
    """A request with images frozen mid-decode by pause('keep') while every weight (the vision tower's
    too) moves to model B: with its KV kept, model B continues over model A's KV; reset, model B
    re-reads the prompt, its images encoded by model B's tower. transformers predicts both."""
    dir_a, _, hf_a, hf_b, processor = vlm
    weights_b = dict(hf_b.state_dict())
    inputs = _inputs(processor, [_image(s, 50 + i) for i, s in enumerate(SIZES[3][:2])])
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4, max_num_batched_tokens=8))
    engine.add_request("r", _ids(inputs), _greedy(), multimodal=_mm(inputs))
    while len(engine.get_request_output("r").output_token_ids) < 3:
        assert engine.step() == []
    request = engine.requests["r"]
    seq, num_cached = list(request.token_ids), request.num_computed_tokens
    engine.pause("keep")
    if fate == "recompute":
        assert engine.reset_prefix_cache(reset_running_requests=True)
    engine.begin_weight_update()
    names = sorted(weights_b)
    for part in (names[::2], names[1::2]):  # transformers 5's in-memory names
        engine.load_weights([(n, weights_b[n]) for n in part])
    assert engine.finish_weight_update() == 1
    engine.resume()
    out = []
    while not out:
        out = engine.step()
    before = len(seq) - len(_ids(inputs))
    assert out[0].token_weight_versions == [0] * before + [1] * (MAX_TOKENS - before)
    kept = _hf_continue(hf_a, hf_b, inputs, seq, num_cached, MAX_TOKENS - before)
    recomputed = _hf_continue(hf_b, hf_b, inputs, seq, 0, MAX_TOKENS - before)
    assert kept != recomputed, "the oracle cannot tell the fates apart here; pick other images"
    assert out[0].output_token_ids[before:] == (kept if fate == "keep" else recomputed)


def test_images_to_a_text_only_model_are_refused(tiny_model_factory, vlm):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen2")), block_size=4))
    inputs = _inputs(vlm[4], [_image((56, 56), 0)])
    with pytest.raises(InvalidRequestError, match=r"Qwen2ForCausalLM\) is text-only and takes no images"):
        engine.add_request("r", [5, 6, 7], _greedy(), multimodal=_mm(inputs))
    assert not engine.has_unfinished_requests()


def test_bad_image_inputs_are_refused(vlm):
    dir_a, _, _, _, processor = vlm
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4))
    inputs = _inputs(processor, [_image((56, 56), 0), _image((84, 56), 1)])
    ids, mm, spec = _ids(inputs), _mm(inputs), engine.vision
    last = max(i for i, t in enumerate(ids) if t == spec.image_token_id)
    counts = [int(g.prod()) // spec.spatial_merge_size**2 for g in mm.image_grid_thw]
    rows = f"{int(mm.image_grid_thw.prod(1).sum())}, {spec.patch_dim}"
    bad = {
        f"placeholder runs .* have lengths \\[{counts[0]}, {counts[1] - 1}\\], but the images need "
        f"\\[{counts[0]}, {counts[1]}\\]": (ids[:last] + ids[last + 1 :], mm),
        f"pixel_values must be a float tensor \\[{rows}\\]": (
            ids,
            MultimodalInput(mm.pixel_values[:-1], mm.image_grid_thw),
        ),
        "NaN or inf": (ids, MultimodalInput(mm.pixel_values * float("nan"), mm.image_grid_thw)),
        "image_hashes must be one non-empty string per image": (
            ids,
            MultimodalInput(mm.pixel_values, mm.image_grid_thw, ("a",)),
        ),
        "multiples of spatial_merge_size": (
            ids,
            MultimodalInput(mm.pixel_values, torch.tensor([[1, 4, 4], [1, 3, 8]])),
        ),
        f"holds {sum(counts)} image placeholder tokens .* but no images": (ids, None),
    }
    for message, (prompt, images) in bad.items():
        with pytest.raises(InvalidRequestError, match=message):
            engine.check_request(prompt, _greedy(), images)
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request("r", prompt, _greedy(), multimodal=images)
    assert not engine.has_unfinished_requests()


def test_async_engine_takes_images(vlm):
    """AsyncEngine.generate and generate_stream pass the images through (transformers' tokens);
    bad images raise before the first await."""
    dir_a, _, hf, _, processor = vlm
    inputs = _inputs(processor, [_image((112, 84), 7)])

    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=str(dir_a), block_size=4))
        whole = await engine.generate(_ids(inputs), _greedy(), multimodal=_mm(inputs))
        streamed = [
            out async for out in engine.generate_stream(_ids(inputs), _greedy(), multimodal=_mm(inputs))
        ]
        with pytest.raises(InvalidRequestError, match="but no images were given"):
            await engine.generate(_ids(inputs), _greedy())
        await engine.close()
        return whole, streamed[-1]

    whole, streamed = asyncio.run(run())
    tokens, _ = _hf_generate(hf, inputs)
    assert whole.output_token_ids == streamed.output_token_ids == tokens
    assert streamed.num_cached_tokens > 0  # the repeat hit the first one's image blocks


def test_update_mid_prefill_encodes_the_images_again(vlm):
    """Frozen mid-prefill with later images already encoded by model A's tower, reset, moved to model
    B: the re-prefill encodes every image with model B's tower (transformers' model B alone)."""
    dir_a, _, _, hf_b, processor = vlm
    inputs = _inputs(processor, [_image(s, 70 + i) for i, s in enumerate(SIZES[3])])
    engine = LLMEngine(EngineConfig(model=str(dir_a), block_size=4, max_num_batched_tokens=8))
    engine.add_request("r", _ids(inputs), _greedy(), multimodal=_mm(inputs))
    plan = engine.requests["r"].images
    while not plan.embeds:
        assert engine.step() == []
    assert engine.requests["r"].num_computed_tokens < plan.spans[-1][0]  # the last image is still to come
    engine.pause("keep")
    assert engine.reset_prefix_cache(reset_running_requests=True)
    weights_b = hf_b.state_dict()
    engine.begin_weight_update()
    engine.load_weights(weights_b.items())
    engine.finish_weight_update()
    engine.resume()
    out = []
    while not out:
        out = engine.step()
    assert out[0].token_weight_versions == [1] * MAX_TOKENS
    assert out[0].output_token_ids == _hf_continue(hf_b, hf_b, inputs, _ids(inputs), 0, MAX_TOKENS)
