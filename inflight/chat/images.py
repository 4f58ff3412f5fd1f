"""Images in chat messages: the content parts that hold one, decoded and checked once, for the server
(OpenAI chat `image_url`, Responses `input_image`) and the data files (SkyRL's rows) alike.

A part holds an image when its `type` is `image_url` (`{"url": ...}` or the URL itself), `input_image`
(`image_url`: the URL; `file_id` is refused: nothing here stores files) or `image` (transformers'
and datasets' spelling: `image`, `url`, `path` or `base64`). The image itself may be
- a `data:` URL (`data:image/png;base64,...`);
- a local file (`file://` URL or a plain path), read only under `ImageLimits.local_root` (the
  server's `--allowed-local-media-path`; a data file's own folder for its rows);
- encoded bytes, or datasets' Image struct `{"bytes", "path"}` (Parquet), or bare base64 text where
  `ImageLimits.bare_base64` allows it (data rows), or an already decoded `PIL.Image.Image`.
`http(s)` URLs are refused: the machines this runs on have no network access.

Every image is checked against `ImageLimits` (its encoded bytes, and its pixels read from the header
before anything is decoded, so a decompression bomb costs nothing), fully decoded (a truncated file
fails here, not in the model) and converted to RGB. A fault is an `ImageError` whose message names it
and whose `code` says which kind (`invalid_image`, `image_too_large`, `image_url_not_allowed`).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The encodings decoded (the only decoders PIL is allowed to try)."""
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGE_BYTES = 10 * 2**20
INLINE_HINT = "send the image inline as a data: URL (data:image/png;base64,...)"


class ImageError(ValueError):
    """An image that cannot be used; `code`: `invalid_image`, `image_too_large` or
    `image_url_not_allowed`; `where`: the part it came from (`messages[0].content[1]`), when known."""

    def __init__(self, message: str, code: str = "invalid_image", where: str | None = None) -> None:
        super().__init__(message)
        self.code, self.where = code, where

    def at(self, where: str) -> ImageError:
        """The same fault, naming the part it came from."""
        return ImageError(f"{where}: {self}", self.code, where)


@dataclass(frozen=True)
class ImageLimits:
    """What an image may be: at most `max_pixels` (width x height) and `max_bytes` encoded (None: no
    limit); local files only under `local_root` (None: none); bare base64 text (no `data:` prefix)
    only with `bare_base64`."""

    max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
    max_bytes: int | None = DEFAULT_MAX_IMAGE_BYTES
    local_root: Path | None = None
    bare_base64: bool = False

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive integer or None (no limit)")


def is_image_part(part: Any) -> bool:
    """Whether a content part holds an image."""
    return isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES


def part_source(part: Mapping[str, Any]) -> Any:
    """The image an image part holds (a URL, a path, bytes, a datasets struct or a PIL image)."""
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        return value.get("url") if isinstance(value, Mapping) else value
    if kind == "input_image":
        if part.get("image_url") is None and part.get("file_id") is not None:
            raise ImageError(f"file_id={part['file_id']!r}: this server stores no files; {INLINE_HINT} in "
                             "image_url", "image_url_not_allowed")
        return part.get("image_url")
    return next((part[k] for k in ("image", "url", "path", "base64") if part.get(k) is not None), None)


def load_image(source: Any, limits: ImageLimits = ImageLimits(), base_dir: Path | None = None) -> Image.Image:
    """The image `source` holds, decoded, checked against `limits` and in RGB; raises ImageError.
    A relative path is taken from `base_dir` (a data file's folder)."""
    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits)
        return source.convert("RGB")
    return _decode(_encoded_bytes(source, limits, base_dir), limits)


def _encoded_bytes(source: Any, limits: ImageLimits, base_dir: Path | None) -> bytes:
    if isinstance(source, bytes | bytearray | memoryview):
        return _sized(bytes(source), limits)
    if isinstance(source, Mapping) and ("bytes" in source or "path" in source):  # datasets' Image struct
        if source.get("bytes") is not None:
            return _sized(bytes(source["bytes"]), limits)
        return _encoded_bytes(source.get("path"), limits, base_dir)
    if not isinstance(source, str) or not source.strip():
        raise ImageError(f"no image: expected a data: URL, a path or bytes, got {_show(source)}")
    text = source.strip()
    scheme = urlparse(text).scheme.lower() if ":" in text[:12] else ""
    if scheme == "data":
        return _data_url(text, limits)
    if scheme in ("http", "https"):
        raise ImageError(f"cannot fetch {_show(text)}: this machine has no network access; {INLINE_HINT}",
                         "image_url_not_allowed")
    if scheme == "file":
        return _local_file(unquote(urlparse(text).path), limits, base_dir)
    if scheme and len(scheme) > 1:  # a one-letter scheme is a Windows drive
        raise ImageError(f"unsupported image URL scheme {scheme!r}; {INLINE_HINT}", "image_url_not_allowed")
    if limits.bare_base64 and not _is_file(text, base_dir):
        try:
            return _sized(_b64(text, "base64"), limits, len(text) * 3 // 4)
        except ImageError as err:
            if err.code != "invalid_image":
                raise
            raise ImageError(f"{_show(text)} is neither an image file (under {str(base_dir or '.')!r}) nor "
                             "base64 image data") from None
    return _local_file(text, limits, base_dir)


def _data_url(url: str, limits: ImageLimits) -> bytes:
    head, comma, payload = url.partition(",")
    media, *params = head[len("data:"):].split(";")
    if not comma or "base64" not in [p.lower() for p in params]:
        raise ImageError(f"data URL {_show(url)} must be base64: data:image/png;base64,<data>")
    if media and not media.lower().startswith("image/"):
        raise ImageError(f"data URL media type {media!r} is not an image (image/png, image/jpeg, ...)")
    return _sized(_b64(payload, "the data URL's base64 payload"), limits, len(payload) * 3 // 4)


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(f"{what} is not valid base64 ({err})") from None


def _is_file(text: str, base_dir: Path | None) -> bool:
    path = Path(text)
    try:
        return (path if path.is_absolute() or base_dir is None else base_dir / path).is_file()
    except (OSError, ValueError):  # too long for a path, a NUL byte
        return False


def _local_file(name: str, limits: ImageLimits, base_dir: Path | None) -> bytes:
    if limits.local_root is None:
        raise ImageError(
            f"local image file {_show(name)} refused: this server reads no local files unless it "
            f"runs with --allowed-local-media-path DIR; {INLINE_HINT}",
            "image_url_not_allowed",
        )
    path = Path(name)
    path = (path if path.is_absolute() or base_dir is None else base_dir / path).resolve()
    root = Path(limits.local_root).resolve()
    if not path.is_relative_to(root):
        raise ImageError(
            f"local image file {_show(name)} is outside {str(root)!r}, the folder images may be read from",
            "image_url_not_allowed",
        )
    try:
        size = path.stat().st_size
        _check_bytes(size, limits)
        return path.read_bytes()
    except OSError as err:
        raise ImageError(f"cannot read image file {_show(name)}: {err.strerror or err}") from None


def _sized(data: bytes, limits: ImageLimits, size: int | None = None) -> bytes:
    _check_bytes(len(data) if size is None else size, limits)
    return data


def _check_bytes(size: int, limits: ImageLimits) -> None:
    if limits.max_bytes is not None and size > limits.max_bytes:
        raise ImageError(f"the image is {size} bytes, over the limit of {limits.max_bytes} bytes "
                         "(--max-image-bytes); send a smaller or more compressed image", "image_too_large")


def _check_pixels(size: tuple[int, int], limits: ImageLimits) -> None:
    width, height = size
    if limits.max_pixels is not None and width * height > limits.max_pixels:
        raise ImageError(
            f"the image is {width}x{height} = {width * height} pixels, over the limit of "
            f"{limits.max_pixels} pixels (--max-image-pixels); send a smaller image",
            "image_too_large",
        )


def _decode(data: bytes, limits: ImageLimits) -> Image.Image:
    _check_bytes(len(data), limits)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(
            f"unreadable image: {len(data)} bytes that are no {', '.join(FORMATS)} image"
        ) from None
    except Image.DecompressionBombError as err:
        raise ImageError(f"the image is too large to decode ({err})", "image_too_large") from None
    _check_pixels(image.size, limits)  # from the header: nothing decoded yet
    if getattr(image, "n_frames", 1) > 1:
        raise ImageError(f"animated images are not supported ({image.n_frames} frames); send one frame")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise ImageError(
            f"unreadable image: the {image.format} data is corrupt or truncated ({err})"
        ) from None


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class SplitMessages:
    """Chat messages with every image part replaced by `{"type": "image"}` (what a vision-language
    chat template turns into its image placeholder), and the images, in order."""

    messages: list[dict[str, Any]]
    images: list[Image.Image]


def decode_images(messages: Sequence[Mapping[str, Any]], limits: ImageLimits = ImageLimits(),
                  base_dir: Path | None = None, param: str = "messages") -> list[dict[str, Any]]:
    """`messages` with every image part decoded and checked, as `{"type": "image", "image": <PIL RGB>}`
    (the input is left as it was); raises ImageError naming the part (`messages[0].content[1]`)."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list) or not any(is_image_part(p) for p in content):
            out.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            if is_image_part(part):
                try:
                    part = {"type": "image", "image": load_image(part_source(part), limits, base_dir)}
                except ImageError as err:
                    raise err.at(f"{param}[{i}].content[{j}]") from None
            parts.append(part)
        out.append({**message, "content": parts})
    return out


def split_images(messages: Sequence[Mapping[str, Any]], limits: ImageLimits = ImageLimits(),
                 base_dir: Path | None = None, param: str = "messages") -> SplitMessages:
    """`messages` with their images decoded and taken out (see `SplitMessages`); raises ImageError
    naming the part (`messages[0].content[1]`)."""
    images: list[Image.Image] = []
    out = []
    for message in decode_images(messages, limits, base_dir, param):
        if isinstance(message.get("content"), list):
            images += [p["image"] for p in message["content"] if is_image_part(p)]
            message = {**message, "content": [{"type": "image"} if is_image_part(p) else p
                                              for p in message["content"]]}
        out.append(message)
    return SplitMessages(out, images)


def count_images(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many image parts `messages` hold."""
    return sum(is_image_part(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])


__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "FORMATS",
    "IMAGE_PART_TYPES",
    "ImageError",
    "ImageLimits",
    "SplitMessages",
    "count_images",
    "decode_images",
    "is_image_part",
    "load_image",
    "part_source",
    "split_images",
]
