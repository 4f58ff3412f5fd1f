"""Let megatron-core run on a machine without CUDA (tests, CPU-only CI). The only such module.

megatron-core assumes a GPU in three places that a CPU run reaches; this module patches exactly
those, and only when `torch.cuda.is_available()` is False (with a GPU, `apply()` does nothing):

1. The RNG tracker (`tensor_parallel.random`): `model_parallel_cuda_manual_seed` and the tracker's
   `add`/`fork` read and write the CUDA generator (`torch.cuda.get_rng_state`), which raises
   "Torch not compiled with CUDA enabled". We install a tracker with the same interface whose named
   states are CPU generator states, so `fork()` (used around dropout in TP regions) works as meant.
2. `torch.cuda.current_device()`: called unguarded to pick the device of buffers and temporaries
   (rotary `inv_freq`, the all-gather/reduce-scatter buffers of `tensor_parallel.mappings`, ...).
   It returns the CPU device instead. Code that checks `torch.cuda.is_available()` first is
   unaffected, because that still returns False.
3. `transformer.utils.get_default_causal_mask` (as imported by `fusions.fused_softmax`) builds the
   causal mask with `device="cuda"` when the caller passes no attention mask; it is rebuilt on CPU.

The patches were written against one megatron-core version (`PINNED_VERSION`); `apply()` refuses any
other with an error saying what to do, since these private call sites move between releases.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

import torch

PINNED_VERSION = "0.16.1"

_applied = False


class MegatronCpuShimError(RuntimeError):
    """megatron-core is missing or not the version this shim was written for."""


def installed_version() -> str | None:
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def _check_version() -> None:
    found = installed_version()
    if found != PINNED_VERSION:
        raise MegatronCpuShimError(
            f"the megatron CPU shim was written and tested for megatron-core=={PINNED_VERSION}, but "
            f"{'no megatron-core is installed' if found is None else f'megatron-core=={found} is installed'}"
            f"; install it with `pip install megatron-core=={PINNED_VERSION}` "
            "(pip install -e '.[megatron]'), or run on a CUDA machine, where the shim is not used"
        )


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's RNG tracker with CPU generator states in place of CUDA ones."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    return CpuRNGStatesTracker


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def apply() -> bool:
    """Patch megatron-core for CPU if there is no CUDA device; returns whether the shim is active.

    Idempotent. Raises MegatronCpuShimError when a patch is needed and megatron-core is missing or
    not `PINNED_VERSION`.
    """
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    _check_version()
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _make_cpu_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.cuda.current_device = _cpu_current_device
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    _applied = True
    return True
