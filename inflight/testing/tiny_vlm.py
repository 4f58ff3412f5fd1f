"""Tiny random vision-language model directories built on the spot (no downloads), and their processors.

`make_tiny_vlm(path)` writes what `Qwen2_5_VLForConditionalGeneration.save_pretrained` writes (a
two-block vision tower and a two-layer language model), the tokenizer of `tiny_model.py` with
Qwen2-VL's vision special tokens, the image processor's settings and a chat template that renders
image content parts as `<|vision_start|><|image_pad|><|vision_end|>`. `make_tiny_qwen3_vl(path)` does
the same for `Qwen3VLForConditionalGeneration` (DeepStack from two of three vision blocks into the first
two of three decoder layers, interleaved M-RoPE, q/k norms, 16-pixel patches as Qwen3-VL's).
`load_tiny_processor(path)` returns transformers' processor for either (`ImageOnlyProcessor`,
`Qwen3VLImageOnlyProcessor`). `TINY_VLMS`: builder and transformers class by model type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from inflight.chat.image_only import ImageOnlyProcessor, image_only, load_image_only
from inflight.testing.tiny_model import make_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE = 14
QWEN3_PATCH_SIZE = 16
MERGE_SIZE = 2
# images of 56 x 56 to 224 x 224 pixels: 4 to 64 placeholder tokens each
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224
VL_CHAT_TEMPLATE = (
    # ChatML with Qwen2-VL's image parts; string contents as in tiny_model.CHAT_TEMPLATE
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


Qwen3VLImageOnlyProcessor = image_only(Qwen3VLProcessor)
"""transformers' Qwen3-VL processor without its video processor."""


def make_vl_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """tiny_model's tokenizer with the vision special tokens and a chat template for image parts."""
    tokenizer = make_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def image_processor(patch_size: int = PATCH_SIZE, **settings: Any) -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor (PIL backend) with the tiny model's patch and merge sizes."""
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=patch_size,
                                    merge_size=MERGE_SIZE, temporal_patch_size=2, **settings)


def vl_config(tokenizer: PreTrainedTokenizerFast, **text_overrides: Any) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config: 2 vision blocks (one windowed, one full attention) of width 32, and a
    2-layer language model of width 64 (`text_overrides` go into its text config)."""
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        initializer_range=0.2,  # peaked logits: greedy decoding not decided by rounding
    )
    text.update(text_overrides)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        window_size=2 * PATCH_SIZE * MERGE_SIZE,
        fullatt_block_indexes=[1],
        initializer_range=0.2,
    )
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        image_token_id=ids[2], video_token_id=ids[3], tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def qwen3_vl_config(tokenizer: PreTrainedTokenizerFast, **text_overrides: Any) -> Qwen3VLConfig:
    """A Qwen3-VL config: 3 vision blocks of width 32 (blocks 0 and 1 feed DeepStack), an 8 x 8 learned
    position grid, and a 3-layer language model of width 64 with q/k norms and interleaved M-RoPE
    (`text_overrides` go into its text config)."""
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True
        ),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=0.2,
    )
    text.update(text_overrides)
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        patch_size=QWEN3_PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0, 1],
        initializer_range=0.2,
    )
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        image_token_id=ids[2], video_token_id=ids[3], tie_word_embeddings=False,
    )


def _save(path: str | Path, seed: int, model_class: type[PreTrainedModel], config, processor) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    tokenizer = processor.tokenizer
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def make_tiny_vlm(path: str | Path, seed: int = 0, **text_overrides: Any) -> Path:
    """Write a random-init Qwen2.5-VL, its tokenizer, image processor and chat template to `path`;
    the same `seed` gives the same weights. Returns the directory."""
    tokenizer = make_vl_tokenizer(seed)
    processor = ImageOnlyProcessor(image_processor(), tokenizer, chat_template=VL_CHAT_TEMPLATE)
    return _save(
        path, seed, Qwen2_5_VLForConditionalGeneration, vl_config(tokenizer, **text_overrides), processor
    )


def make_tiny_qwen3_vl(path: str | Path, seed: int = 0, **text_overrides: Any) -> Path:
    """Write a random-init Qwen3-VL (dense), its tokenizer, image processor (16-pixel patches, Qwen3-VL's
    mean and std of 0.5) and chat template to `path`; the same `seed` gives the same weights."""
    tokenizer = make_vl_tokenizer(seed)
    images = image_processor(QWEN3_PATCH_SIZE, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen3VLImageOnlyProcessor(images, tokenizer, chat_template=VL_CHAT_TEMPLATE)
    return _save(
        path, seed, Qwen3VLForConditionalGeneration, qwen3_vl_config(tokenizer, **text_overrides), processor
    )


TINY_VLMS: dict[str, tuple[Any, type[PreTrainedModel]]] = {
    "qwen2_5_vl": (make_tiny_vlm, Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (make_tiny_qwen3_vl, Qwen3VLForConditionalGeneration),
}
"""model type -> (the directory builder, transformers' model class)."""


def load_tiny_processor(path: str | Path) -> ImageOnlyProcessor | Qwen3VLImageOnlyProcessor:
    """The processor of a `make_tiny_vlm` / `make_tiny_qwen3_vl` directory, from its files."""
    return load_image_only(path, AutoConfig.from_pretrained(path))
