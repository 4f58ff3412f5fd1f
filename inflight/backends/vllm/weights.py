"""Weight updates into vLLM, all or nothing: chunks are checked and staged here, and at finish the
complete set goes into vLLM in one reload.

The model's parameters (HF names, shapes, dtypes) are read from its checkpoint's safetensors
headers; a mixture of experts' fused expert tensors (transformers 5's names, what a trainer sends) are
staged as the checkpoint's per-expert ones (`experts.py`). Each chunk is refused (400, naming the
parameter) for an unknown name, a wrong shape, an
integer tensor for a floating weight, NaN/inf, or magnitudes beyond the model dtype's range; a
refused chunk stages nothing. At finish the staged tensors are written as one safetensors file
(in /dev/shm when there is one) and vLLM's worker reloads from it (`collective_rpc("reload_weights",
weights_path=..., is_checkpoint_format=True)`: vLLM's layerwise reload, which runs each layer's
post-load processing again, so the oneDNN-packed copies on CPU are re-made from the new weights;
a plain `load_weights` would write into weights the packed copies no longer read), then the copies
that reload misses are made again (`repack_vocabulary`: a tied LM head; `repack_experts`: a mixture
of experts' weights, which vLLM 0.32's reload leaves unpacked).
Chunks arrive as safetensors bytes (the chunk route) or through the trainer's broadcast group
(`broadcast.py`: copied out of the group's buffer, a tensor split over several chunks put back
together from its pieces); both are checked and staged alike.

vLLM keeps no copy of the old weights: if the reload fails, the shim reloads the last complete
weights (the checkpoint, or the file of the last update) and reports the failure; if that fails
too, the weights are unknown and the server stays paused (`invalid`, `can_roll_back` false).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from .errors import weight_error
from .experts import FusedExperts
from .shared import chunking

log = logging.getLogger("inflight.backends.vllm")

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_MAX = {"F32": 3.4028234663852886e38, "F16": 65504.0, "BF16": 3.3895313892515355e38}


def read_header(path: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensors: name -> {"dtype", "shape"} (its JSON header, nothing else read)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: v for k, v in header.items() if k != "__metadata__"}


def checkpoint_parameters(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Every tensor of the model's checkpoint (all its safetensors files)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: the vLLM backend updates weights by "
                                "their safetensors names")
    params: dict[str, dict[str, Any]] = {}
    for file in files:
        params.update(read_header(file))
    return params


class WeightStage:
    """The update being received: checked chunks, kept until finish writes them for vLLM."""

    def __init__(self, model_dir: Path) -> None:
        self.params = checkpoint_parameters(model_dir)
        self.experts = FusedExperts(self.params)  # fused expert names, against per-expert checkpoints
        self.staged: dict[str, Any] = {}
        self.pieces = chunking.Reassembler()  # split tensors of broadcast chunks, until their last piece
        self.complete_dir: Path = Path(model_dir)  # where the last complete weights load from
        self.owned: Path | None = None  # a directory this class wrote (removed when replaced)
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        self.root = Path(tempfile.mkdtemp(prefix="inflight-vllm-weights-", dir=root))

    def clear(self) -> None:
        self.staged = {}
        self.pieces.clear()

    def check_and_stage(self, tensors: list[tuple[str, Any]]) -> int:
        """Check every tensor of one chunk, then stage them all (a refused chunk stages nothing)."""
        for name, tensor in tensors:
            self._check(name, tensor)
        for name, tensor in tensors:
            for part, value in self.experts.split(name, tensor):
                self.staged[part] = value
        return len(tensors)

    def stage_chunk(self, metas: list[Any], flat: Any) -> int:
        """Stage one broadcast chunk: `chunking.TensorMeta` entries over `flat`, the group's buffer
        (reused by the next chunk, so every tensor is copied out, into host memory); a split tensor
        is staged once its last piece came. Names and shapes are checked before anything is
        copied; returns the tensors staged."""
        for meta in metas:
            self._check_name_and_shape(meta.name, meta.shape)
        host = flat if flat.device.type == "cpu" else flat.to("cpu")  # nccl: one copy off the device
        tensors: list[tuple[str, Any]] = []
        for meta in metas:
            if meta.whole:  # a copy of its own: tensors sharing storage cannot be written as safetensors
                tensors.append((meta.name, chunking.view_entry(meta, host).clone()))
            else:
                tensors += self.pieces.add([meta], host)
        return self.check_and_stage(tensors)

    def _check_name_and_shape(self, name: str, shape: Any) -> dict[str, Any]:
        spec = self.params.get(name)
        fused = self.experts.shape(name) if spec is None else None
        if fused is not None:
            spec = {**self.experts.specs[name], "shape": fused}
        if spec is None:
            sample = ", ".join(sorted(self.params)[:3])
            raise weight_error(f"unknown parameter {name!r}: the model has {len(self.params)} parameters "
                               f"(e.g. {sample}); send HF checkpoint names", param=name)
        if list(shape) != list(spec["shape"]):
            raise weight_error(f"parameter {name!r}: shape {list(shape)} does not match the model's "
                               f"{list(spec['shape'])}", param=name)
        return spec

    def _check(self, name: str, tensor: Any) -> None:
        import torch

        spec = self._check_name_and_shape(name, tensor.shape)
        floating = spec["dtype"] in _FLOAT_DTYPES
        if floating and not tensor.is_floating_point():
            raise weight_error(
                f"parameter {name!r}: an integer tensor ({tensor.dtype}) for a floating weight "
                f"({spec['dtype']})",
                param=name,
            )
        if floating and tensor.numel():
            values = tensor.float() if tensor.dtype.itemsize < 4 else tensor
            if not bool(torch.isfinite(values).all()):
                raise weight_error(f"parameter {name!r}: holds NaN or inf", param=name)
            limit = _MAX.get(spec["dtype"])
            if limit is not None and float(values.abs().max()) > limit:
                raise weight_error(
                    f"parameter {name!r}: magnitudes beyond {spec['dtype']}'s range", param=name
                )

    def missing(self) -> list[str]:
        return sorted(set(self.params) - set(self.staged))

    def incomplete(self) -> list[str]:
        """Split tensors of broadcast chunks still missing pieces."""
        return self.pieces.incomplete

    def write(self, version: int) -> Path:
        """The staged tensors as one checkpoint directory for vLLM's reload."""
        from safetensors.torch import save_file

        target = self.root / f"v{version}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        save_file({k: v.contiguous() for k, v in self.staged.items()}, str(target / "model.safetensors"))
        return target

    def landed(self, directory: Path) -> None:
        """`directory` holds the complete weights now in vLLM; the previous file is no longer needed."""
        if self.owned is not None and self.owned != directory:
            shutil.rmtree(self.owned, ignore_errors=True)
        self.complete_dir = self.owned = directory
        self.staged = {}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def repack_vocabulary(worker: Any) -> list[str]:
    """Run in vLLM's worker: derive again the CPU GEMM copy of every vocabulary embedding and LM
    head from its weight. vLLM 0.32's layerwise reload leaves a tied LM head's packed copy on the
    old weights (the trunk serves the new model, the logits the old one: neither model's tokens);
    re-processing these modules after the reload fixes it, and is a no-op for correct ones."""
    done = []
    for name, module in worker.model_runner.model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(module).__name__
        if (
            kind in ("VocabParallelEmbedding", "ParallelLMHead")
            and method is not None
            and hasattr(module, "cpu_linear")
        ):
            method.process_weights_after_loading(module)
            done.append(name)
    return done


def repack_experts(worker: Any) -> list[str]:
    """Run in vLLM's worker: pack again, for its CPU grouped-gemm kernel, every mixture of experts'
    expert weights. vLLM 0.32's layerwise reload leaves them in the checkpoint's layout (it runs the
    expert kernel's packing only at the first load), so an MoE served after an update, even of the
    same weights, computes garbage; packing the reloaded layout again restores it. Experts whose
    intermediate size vLLM pads are refused (their reloaded layout is not the one this packs)."""
    done = []
    for name, module in worker.model_runner.model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__):
            continue
        if experts._use_zentorch:
            continue  # zentorch reads the unpacked layout
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: vLLM pads this model's expert width ({config.intermediate_size_per_partition}) "
                "for its CPU kernel, and its in-place reload cannot be repaired for it; serve it with "
                "the native backend"
            )
        experts.process_weights_after_loading(module)
        done.append(name)
    return done


def _send_by_value() -> None:
    """`repack_vocabulary` and `repack_experts` travel to vLLM's worker pickled by value: this private package
    is not importable there (vLLM pickles callables with cloudpickle, allowed by
    VLLM_ALLOW_INSECURE_SERIALIZATION=1, which the launcher sets for its own processes' IPC)."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


async def reload(engine: Any, directory: Path) -> None:
    """vLLM's worker(s) reload every weight from `directory` (layerwise, re-packing on CPU), then
    the vocabulary's packed copies (`repack_vocabulary`) and a mixture of experts' (`repack_experts`)."""
    await engine.collective_rpc("reload_weights", kwargs={"weights_path": os.fspath(directory),
                                                          "is_checkpoint_format": True})
    _send_by_value()
    await engine.collective_rpc(repack_vocabulary)
    await engine.collective_rpc(repack_experts)
