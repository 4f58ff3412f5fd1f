"""Vision-language models (Qwen2.5-VL, Qwen3-VL): transformers' own vision tower, the text decoder of
`common.py` over the paged KV cache with the image embeddings written over the placeholder tokens, and
multimodal rotary positions (M-RoPE). A family's subclass names what differs (its tower, its rotary
class and q/k norms, how M-RoPE lays out its columns); the number of DeepStack layers comes from the
vision config (`deepstack_visual_indexes`, Qwen3-VL).

M-RoPE rotates each rotary column by one of three positions (temporal, height, width). Row i of a
step's rotary table is gathered from the ordinary table at those three positions, so the layers
rotate with the same kernels as for text. Qwen2.5-VL gives the axes contiguous column blocks
(`mrope_section`), Qwen3-VL interleaves them (t, h, w, t, h, w, ...; the tail is t).

DeepStack (Qwen3-VL): the tower also returns merged features of some of its blocks; the k-th is
added to the image placeholders' hidden states after decoder layer k. An image's encoding is one
tensor, [placeholders, hidden * (1 + deepstack layers)]: the embedding, then those features, so the
image plan slices and keeps them together.

Parameter names are the checkpoint's (`model.layers.*`, `visual.*`, `lm_head.weight`); transformers
5's names (`model.language_model.*`, `model.visual.*`, what Qwen3-VL checkpoints hold) resolve onto them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from inflight.engine.models.common import DecoderForCausalLM
from inflight.engine.multimodal import MultimodalStep, VisionSpec

_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def mrope_axes(section: list[int], half: int, interleaved: bool) -> torch.Tensor:
    """[half] the position axis (0: t, 1: h, 2: w) of each rotary frequency: contiguous blocks of
    `section`'s sizes (Qwen2-VL, Qwen2.5-VL), or interleaved, h and w every third column from 1 and 2
    for section[1] and section[2] columns, t the rest (Qwen3-VL)."""
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    axis = torch.zeros(half, dtype=torch.long)
    axis[1 : 3 * section[1] : 3] = 1
    axis[2 : 3 * section[2] : 3] = 2
    return axis


class VisionLanguageModel(DecoderForCausalLM):
    """Base of the vision-language families; subclasses set `spec`, `vision_tower`, `interleaved_mrope`."""

    vision_tower: ClassVar[type]  # transformers' own vision module
    interleaved_mrope: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig) -> None:
        text = config.text_config
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text)
        self.vl_config = config
        vision = config.vision_config
        self.visual = self.vision_tower._from_config(vision)
        self.vision = VisionSpec(
            image_token_id=config.image_token_id,
            spatial_merge_size=vision.spatial_merge_size,
            patch_dim=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        )
        self.deepstack_layers = len(getattr(vision, "deepstack_visual_indexes", None) or ())
        self.mrope_axis: torch.Tensor | None = None  # [head_dim]: the position axis (t, h, w) of each column
        self.weight_generation = 0  # bumped at every change of the weights: image embeddings are made anew

    def init_rotary(self, device: torch.device) -> None:
        super().init_rotary(device)
        # the vision tower's rotary buffer is not in the checkpoint: made anew on the device
        rotary = type(self.visual.rotary_pos_emb)
        self.visual.rotary_pos_emb = rotary(self.vl_config.vision_config).to(device)
        section = list(self.config.rope_parameters["mrope_section"])
        axis = mrope_axes(section, self.head_dim // 2, self.interleaved_mrope)
        self.mrope_axis = torch.cat((axis, axis)).to(device)

    def forward(self, input_ids, positions, meta, kv, routing=None, mm: MultimodalStep | None = None):
        """As the text model's forward; with `mm`, image embeddings replace the placeholder rows (and
        DeepStack's features join them after the first layers) and each token rotates by its M-RoPE
        positions (`positions` is then unused)."""
        embeds = self.model.embed_tokens.forward(input_ids)
        if mm is None:
            return self.run_layers(embeds, positions, self.cos_sin, meta, kv, routing)
        deepstack = None
        if mm.rows.numel():
            width = embeds.shape[1]
            images = mm.embeds.to(embeds.dtype)
            embeds[mm.rows] = images[:, :width]
            if self.deepstack_layers:
                deepstack = (
                    mm.rows,
                    images[:, width:].unflatten(1, (self.deepstack_layers, width)).transpose(0, 1),
                )
        picked = self.cos_sin[mm.positions]  # [3, T, 2, head_dim]
        index = self.mrope_axis.view(1, 1, 1, -1).expand(1, *picked.shape[1:])
        table = picked.gather(0, index)[0].contiguous()
        rows = torch.arange(table.shape[0], device=table.device)
        return self.run_layers(embeds, rows, table, meta, kv, routing, deepstack)

    def encode_images(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Each image's encoding ([t*h*w / merge**2, hidden * (1 + DeepStack layers)]), in one tower call."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        grid = torch.tensor(grids, dtype=torch.long)
        out = self.visual(pixel_values.to(device=self.cos_sin.device, dtype=dtype), grid_thw=grid)
        merged = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=1)
        merge = self.vision.spatial_merge_size**2
        return list(torch.split(merged, [t * h * w // merge for t, h, w in grids]))

    def weights_changed(self) -> None:
        super().weights_changed()
        self.weight_generation += 1

    def resolve(self, hf_name: str) -> str | None:
        for old, new in _RENAMES:
            if hf_name.startswith(old):
                hf_name = new + hf_name[len(old):]
                break
        return super().resolve(hf_name)
