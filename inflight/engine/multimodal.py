"""Images in a request: what the caller passes (`MultimodalInput`), and what the engine derives from
it once, at admission (`ImagePlan`): each image's placeholder span, the multimodal rotary positions
(M-RoPE: temporal, height, width per token) and the per-image keys that go into prefix-cache hashes.

The prompt already holds the placeholder tokens, one per merged patch (`image_grid_thw.prod() //
spatial_merge_size**2` per image, what the Hugging Face processor writes); the engine computes the
image embeddings with the model's vision tower when a prefill chunk first needs them (an image wholly
inside a prefix-cache hit is never encoded) and writes them over those placeholders' embeddings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inflight.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class MultimodalInput:
    """The images of one request, as the Hugging Face image processor returns them (batched: the
    images in prompt order, their patch rows one after another).

    `pixel_values`: [sum over images of t*h*w, channels * temporal_patch * patch * patch] floats.
    `image_grid_thw`: [images, 3] integers, each image's (t, h, w) patch grid.
    `image_hashes`: one string per image identifying its pixel values (e.g. a sha256 of the image
    bytes and the processor settings); None: the engine hashes each image's pixel rows itself. Two
    requests whose images have the same hash and grid share prefix-cache blocks, so a hash must
    never stand for two different pixel contents.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_hashes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class VisionSpec:
    """What a vision-language model expects of its images."""

    image_token_id: int
    spatial_merge_size: int
    patch_dim: int  # columns of pixel_values: channels * temporal_patch * patch * patch


@dataclass
class MultimodalStep:
    """A model step's inputs beyond token ids, made when a scheduled request has images."""

    positions: torch.Tensor  # [3, T] M-RoPE positions of the step's tokens
    rows: torch.Tensor  # [R] the step's rows that are image placeholders
    # [R, hidden * (1 + DeepStack layers)] their image encodings (models/vision_language.py)
    embeds: torch.Tensor


Encoder = Callable[[torch.Tensor, list[tuple[int, int, int]]], list[torch.Tensor]]


@dataclass
class ImagePlan:
    """A request's images as the engine runs them: spans, M-RoPE positions, cache keys, embeddings."""

    pixel_values: torch.Tensor
    grids: list[tuple[int, int, int]]
    spans: list[tuple[int, int]]  # [start, end) of each image's placeholders in the prompt
    keys: list[tuple[str, tuple[int, int, int]]]  # (content hash, grid) per image
    positions: torch.Tensor  # [3, prompt tokens] int64
    delta: int  # a position past the prompt is its index + delta on all three axes
    # image index -> its merged embeddings, made with the weights of `generation`
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    generation: int = -1

    def block_key(self, start: int, end: int) -> tuple:
        """The keys of the images with placeholders among prompt tokens [start, end) (a KV block):
        part of that block's prefix-cache hash."""
        return tuple(key for key, (a, b) in zip(self.keys, self.spans, strict=True) if a < end and start < b)

    def positions_of(self, start: int, count: int) -> torch.Tensor:
        """[3, count] M-RoPE positions of tokens start .. start + count - 1 (prompt or output)."""
        prompt = self.positions.shape[1]
        head = self.positions[:, start : min(start + count, prompt)]
        if start + count <= prompt:
            return head
        tail = torch.arange(max(start, prompt), start + count, dtype=torch.long) + self.delta
        return torch.cat((head, tail.expand(3, -1)), dim=1)

    def embeddings(
        self, start: int, count: int, encode: Encoder, generation: int
    ) -> list[tuple[int, torch.Tensor]]:
        """(offset in the chunk, embeddings) of the placeholders among tokens [start, start + count).
        The first chunk that needs an image encodes it with every later image not encoded yet, in one
        call of `encode` (the vision tower); an image whose placeholders are all before `start` is
        dropped (a reset encodes it again), as is everything made before the weights changed."""
        end = start + count
        needed = [i for i, (a, b) in enumerate(self.spans) if a < end and start < b]
        if generation != self.generation:
            self.embeds, self.generation = {}, generation
        for i in [i for i in self.embeds if self.spans[i][1] <= start]:
            del self.embeds[i]
        if any(i not in self.embeds for i in needed):
            todo = [i for i, (_, b) in enumerate(self.spans) if b > start and i not in self.embeds]
            pixels = torch.cat([self.pixel_values[self.pixel_rows(i)] for i in todo])
            self.embeds.update(zip(todo, encode(pixels, [self.grids[i] for i in todo]), strict=True))
        out = []
        for i in needed:
            a, b = self.spans[i]
            lo, hi = max(a, start), min(b, end)
            out.append((lo - start, self.embeds[i][lo - a : hi - a]))
        return out

    def pixel_rows(self, image: int) -> slice:
        """The rows of `pixel_values` that hold image `image`'s patches."""
        first = sum(t * h * w for t, h, w in self.grids[:image])
        t, h, w = self.grids[image]
        return slice(first, first + t * h * w)


def plan_images(
    prompt: list[int], mm: MultimodalInput, spec: VisionSpec | None, model_name: str
) -> ImagePlan:
    """Check a request's images against its prompt and the model; raises InvalidRequestError naming
    what is wrong and how to fix it."""
    if spec is None:
        raise InvalidRequestError(
            f"this model ({model_name}) is text-only and takes no images; send the request without images "
            "or serve a vision-language model (e.g. Qwen2_5_VLForConditionalGeneration)"
        )
    grid, pixels = mm.image_grid_thw, mm.pixel_values
    if (
        not isinstance(grid, torch.Tensor)
        or grid.dim() != 2
        or grid.shape[1] != 3
        or grid.is_floating_point()
    ):
        raise InvalidRequestError(
            f"image_grid_thw must be an integer tensor [images, 3], got {_describe(grid)}"
        )
    grids = [tuple(int(v) for v in row) for row in grid.tolist()]
    merge = spec.spatial_merge_size
    bad = [g for g in grids if min(g) < 1 or g[1] % merge or g[2] % merge]
    if not grids or bad:
        raise InvalidRequestError(
            f"image_grid_thw {bad or grids}: each image needs t, h, w >= 1 with h and w "
            f"multiples of spatial_merge_size={merge} (what the model's image processor makes)"
        )
    rows = sum(t * h * w for t, h, w in grids)
    if (
        not isinstance(pixels, torch.Tensor)
        or not pixels.is_floating_point()
        or tuple(pixels.shape) != (rows, spec.patch_dim)
    ):
        raise InvalidRequestError(
            f"pixel_values must be a float tensor [{rows}, {spec.patch_dim}] for image_grid_thw {grids} "
            f"(the image processor's output for this model), got {_describe(pixels)}"
        )
    if not torch.isfinite(pixels).all():
        raise InvalidRequestError("pixel_values hold NaN or inf; send the image processor's output unchanged")
    hashes = mm.image_hashes
    if hashes is None:
        hashes = tuple(_pixel_hash(pixels, grids, i) for i in range(len(grids)))
    elif len(hashes) != len(grids) or not all(isinstance(h, str) and h for h in hashes):
        raise InvalidRequestError(
            f"image_hashes must be one non-empty string per image ({len(grids)}), got {hashes!r}"
        )
    counts = [t * h * w // merge**2 for t, h, w in grids]
    runs = _runs(prompt, spec.image_token_id)
    if [b - a for a, b in runs] != counts:
        raise InvalidRequestError(
            f"the prompt's image placeholder runs (token {spec.image_token_id}) have lengths "
            f"{[b - a for a, b in runs]}, but the images need {counts} in this order: render the prompt with "
            "the model's processor (one run of t*h*w/merge**2 placeholders per image, text between images)"
        )
    positions, delta = rope_positions(len(prompt), runs, grids, merge)
    keys = [(h, g) for h, g in zip(hashes, grids, strict=True)]
    return ImagePlan(pixels, grids, runs, keys, positions, delta)


def rope_positions(
    length: int, spans: list[tuple[int, int]], grids: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's multimodal rotary positions of a prompt ([3, length]) and the delta that continues
    them past it: text advances all three axes by one a token; an image's tokens take (t, row, column)
    of its merged grid offset by the position it starts at, and the text after it resumes at that
    position + max(rows, columns)."""
    parts, pos, done = [], 0, 0
    for (start, end), (t, h, w) in zip(spans, grids, strict=True):
        parts.append(torch.arange(pos, pos + start - done).expand(3, -1))
        pos += start - done
        h, w = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(torch.stack((tt, hh, ww)).reshape(3, -1) + pos)
        pos += max(h, w)
        done = end
    parts.append(torch.arange(pos, pos + length - done).expand(3, -1))
    positions = torch.cat(parts, dim=1).long()
    return positions, int(positions.max()) + 1 - length


def _runs(prompt: list[int], token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(prompt):
        if t != token:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _pixel_hash(pixels: torch.Tensor, grids: list[tuple[int, int, int]], image: int) -> str:
    first = sum(t * h * w for t, h, w in grids[:image])
    t, h, w = grids[image]
    rows = pixels[first : first + t * h * w].detach().contiguous().cpu()
    return hashlib.blake2b(rows.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}"
    return type(x).__name__
