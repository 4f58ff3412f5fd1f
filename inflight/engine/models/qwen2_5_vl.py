"""Qwen2.5-VL (dense): transformers' own vision tower, a Qwen2 decoder over the paged KV cache with
the image embeddings written over the placeholder tokens, and multimodal rotary positions (M-RoPE).

M-RoPE rotates the columns of each rotary section by one of three positions (temporal, height,
width; `mrope_section` of the text config). Row i of a step's rotary table is gathered from the
ordinary table at those three positions, so the layers rotate with the same kernels as for text.
Parameter names are the checkpoint's (`model.layers.*`, `visual.*`, `lm_head.weight`); transformers
5's in-memory names (`model.language_model.*`, `model.visual.*`) resolve onto them.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLRotaryEmbedding,
    Qwen2_5_VLVisionRotaryEmbedding,
)

from inflight.engine.models.common import ArchSpec, DecoderForCausalLM
from inflight.engine.multimodal import MultimodalStep, VisionSpec

_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen2_5_VLForConditionalGeneration(DecoderForCausalLM):
    spec = ArchSpec(qk_norm=False, rotary_class=Qwen2_5_VLRotaryEmbedding)
    vision_tower: type = Qwen2_5_VisionTransformerPretrainedModel  # transformers' own module

    def __init__(self, config: PretrainedConfig) -> None:
        text = config.text_config
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text)
        self.vl_config = config
        self.visual = self.vision_tower._from_config(config.vision_config)
        vision = config.vision_config
        self.vision = VisionSpec(
            image_token_id=config.image_token_id,
            spatial_merge_size=vision.spatial_merge_size,
            patch_dim=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        )
        self.mrope_section: list[int] = list(text.rope_parameters["mrope_section"])
        self.mrope_axis: torch.Tensor | None = None  # [head_dim]: the position axis (t, h, w) of each column
        self.weight_generation = 0  # bumped at every change of the weights: image embeddings are made anew

    def init_rotary(self, device: torch.device) -> None:
        super().init_rotary(device)
        # the vision tower's rotary buffer is not in the checkpoint: made anew on the device
        self.visual.rotary_pos_emb = Qwen2_5_VLVisionRotaryEmbedding(self.vl_config.vision_config).to(device)
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(self.mrope_section)])
        self.mrope_axis = torch.cat((axis, axis)).to(device)

    def forward(self, input_ids, positions, meta, kv, routing=None, mm: MultimodalStep | None = None):
        """As the text model's forward; with `mm`, image embeddings replace the placeholder rows and
        each token rotates by its M-RoPE positions (`positions` is then unused)."""
        embeds = self.model.embed_tokens.forward(input_ids)
        if mm is None:
            return self.run_layers(embeds, positions, self.cos_sin, meta, kv, routing)
        if mm.rows.numel():
            embeds[mm.rows] = mm.embeds.to(embeds.dtype)
        picked = self.cos_sin[mm.positions]  # [3, T, 2, head_dim]
        index = self.mrope_axis.view(1, 1, 1, -1).expand(1, *picked.shape[1:])
        table = picked.gather(0, index)[0].contiguous()
        rows = torch.arange(table.shape[0], device=table.device)
        return self.run_layers(embeds, rows, table, meta, kv, routing)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The merged embeddings of each image ([t*h*w / merge**2, hidden] each), in one tower call."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        grid = torch.tensor(grids, dtype=torch.long)
        out = self.visual(pixel_values.to(device=self.cos_sin.device, dtype=dtype), grid_thw=grid).pooler_output
        merge = self.vision.spatial_merge_size**2
        return list(torch.split(out, [t * h * w // merge for t, h, w in grids]))

    def weights_changed(self) -> None:
        super().weights_changed()
        self.weight_generation += 1

    def resolve(self, hf_name: str) -> str | None:
        for old, new in _RENAMES:
            if hf_name.startswith(old):
                hf_name = new + hf_name[len(old):]
                break
        return super().resolve(hf_name)
