"""A tiny random Qwen2.5-VL directory built on the spot (no downloads), and its processor.

`make_tiny_vlm(path)` writes what `Qwen2_5_VLForConditionalGeneration.save_pretrained` writes (a
two-block vision tower and a two-layer language model), the tokenizer of `tiny_model.py` with
Qwen2-VL's vision special tokens, the image processor's settings and a chat template that renders
image content parts as `<|vision_start|><|image_pad|><|vision_end|>`. `load_tiny_processor(path)`
returns transformers' Qwen2.5-VL processor for it without its video part (`inflight.chat.image_only`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from inflight.chat.image_only import ImageOnlyProcessor, load_image_only
from inflight.testing.tiny_model import make_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE = 14
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


def make_vl_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """tiny_model's tokenizer with the vision special tokens and a chat template for image parts."""
    tokenizer = make_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor (PIL backend) with the tiny model's patch and merge sizes."""
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                                    merge_size=MERGE_SIZE, temporal_patch_size=2)


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
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
                  window_size=2 * PATCH_SIZE * MERGE_SIZE, fullatt_block_indexes=[1], initializer_range=0.2)
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        image_token_id=ids[2], video_token_id=ids[3], tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def make_tiny_vlm(path: str | Path, seed: int = 0, **text_overrides: Any) -> Path:
    """Write a random-init Qwen2.5-VL, its tokenizer, image processor and chat template to `path`;
    the same `seed` gives the same weights. Returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_vl_tokenizer(seed)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(vl_config(tokenizer, **text_overrides)).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    ImageOnlyProcessor(image_processor(), tokenizer, chat_template=VL_CHAT_TEMPLATE).save_pretrained(path)
    return path


def load_tiny_processor(path: str | Path) -> ImageOnlyProcessor:
    """The processor of a `make_tiny_vlm` directory, from its files."""
    return load_image_only(path, AutoConfig.from_pretrained(path))
