"""The HTTP wire format shared by the server and RemoteClient: route paths, and weight chunks as
HF-named tensors in one safetensors buffer (the request body, or a chunk file in /dev/shm that a
client on the server's host names in `?shm=`)."""

from __future__ import annotations

import base64
import binascii
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import load as _load
from safetensors.torch import save as _save

from inflight.client.routes import *  # noqa: F403  (the route paths, one source: see routes.py)
from inflight.client.routes import CHUNK_FILE_PREFIX, SHM_DIR
from inflight.engine.multimodal import MultimodalInput
from inflight.weight_sync.group import DEFAULT_WEIGHT_GROUP  # noqa: F401  (the routes' default group name)

CONTENT_TYPE = "application/octet-stream"


def response_body(response: Any) -> Any:
    """A response's JSON, or its text when it is not JSON (e.g. a proxy's error page)."""
    try:
        return response.json()
    except ValueError:
        return response.text


def encode_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Serialize (hf_name, tensor) pairs; tensors are moved to CPU and copied where safetensors needs
    a tensor of its own (views, non-contiguous tensors, tied weights sharing one storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        storage = t.untyped_storage()
        if not t.is_contiguous() or storage.data_ptr() in seen or storage.nbytes() != t.nbytes:
            t = t.contiguous().clone()
            storage = t.untyped_storage()
        seen.add(storage.data_ptr())
        out[name] = t
    return _save(out)


def write_chunk_file(data: bytes) -> str:
    """Write one chunk's bytes to a fresh chunk file in SHM_DIR (servers on this host read it by the
    returned name, `?shm=NAME`); the caller removes it with `remove_chunk_file`."""
    name = f"{CHUNK_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    with open(os.path.join(SHM_DIR, name), "xb") as f:
        f.write(data)
    return name


def remove_chunk_file(name: str) -> None:
    """Unlink a chunk file written by `write_chunk_file` (gone already: nothing to do)."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def decode_tensors(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """Parse a safetensors buffer into (hf_name, tensor) pairs; raises ValueError on bad bytes."""
    if not data:
        raise ValueError("the body is empty; expected a safetensors buffer of HF-named tensors")
    try:
        return list(_load(bytes(data)).items())
    except Exception as err:  # safetensors raises its own error type (and others) on bad bytes
        raise ValueError(f"the body is not a valid safetensors buffer: {err}") from err


def encode_images(mm: MultimodalInput) -> dict[str, Any]:
    """A request's images (`MultimodalInput`) as JSON for the token route's `multimodal` field: the
    tensors in one base64 safetensors buffer, the hashes as a list (or null)."""
    data = encode_tensors([("pixel_values", mm.pixel_values), ("image_grid_thw", mm.image_grid_thw)])
    return {"tensors": base64.b64encode(data).decode("ascii"),
            "image_hashes": None if mm.image_hashes is None else list(mm.image_hashes)}


def decode_images(value: dict[str, Any]) -> MultimodalInput:
    """`encode_images`' JSON back as a `MultimodalInput`; ValueError naming what is wrong (the
    engine checks the tensors against the prompt and the model as it admits the request)."""
    try:
        tensors = dict(decode_tensors(base64.b64decode(value["tensors"], validate=True)))
        hashes = value.get("image_hashes")
        return MultimodalInput(tensors["pixel_values"], tensors["image_grid_thw"],
                               None if hashes is None else tuple(str(h) for h in hashes))
    except (KeyError, TypeError, ValueError, binascii.Error) as err:
        raise ValueError(
            "multimodal must be {'tensors': base64 safetensors of pixel_values and image_grid_thw, "
            f"'image_hashes': [...] or null}} ({type(err).__name__}: {err})"
        ) from err


def chunk_by_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
                   ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into chunks of at most `max_bytes` (a larger tensor travels alone)."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk
