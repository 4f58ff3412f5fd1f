"""A received weight's copy into engine memory counts its non-finite values in the same pass
(`kernels/weight_copy.c`, every ISA level this CPU runs), equal to torch's copy and `isfinite`."""

from __future__ import annotations

import pytest
import torch

from inflight.engine.errors import WeightUpdateError
from inflight.engine.weight_copy import _EXPONENT_BITS, copy_weight

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-42, -1e-40, 65504.0, -3.0e38]


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen).to(dtype)
    if n:
        at = torch.randint(0, n, (min(n, 9),), generator=gen)
        specials = torch.tensor(SPECIALS, dtype=torch.float32)[
            torch.randint(0, len(SPECIALS), (len(at),), generator=gen)
        ]
        values[at] = specials.to(dtype)
    return values


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n", [0, 1, 15, 17, 1023, (1 << 20) + 3])  # tails and the threaded path
def test_native_copy_is_torch_copy_and_counts_what_isfinite_refuses(lib, dtype, n):
    src = _values(dtype, n, seed=n)
    dst = torch.full_like(src, 7.0)
    bad = lib.copy_count_nonfinite(
        dst.data_ptr(), src.data_ptr(), n, src.element_size(), _EXPONENT_BITS[dtype], 2
    )
    assert bad == int((~torch.isfinite(src)).sum())
    assert torch.equal(dst.view(torch.int16 if src.element_size() == 2 else torch.int32),
                       src.view(torch.int16 if src.element_size() == 2 else torch.int32))  # bit for bit


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_copy_weight_refuses_nan_and_inf_naming_the_weight(kernel_isa, dtype):
    good = _values(dtype, 4096, seed=1)
    good = torch.where(torch.isfinite(good), good, torch.zeros_like(good))
    dst = torch.empty_like(good)
    copy_weight(dst, good, "w")
    assert torch.equal(dst, good)
    for special in (float("nan"), float("-inf")):
        bad = good.clone()
        bad[4095] = special
        with pytest.raises(WeightUpdateError, match=r"parameter 'w' holds NaN or inf"):
            copy_weight(torch.empty_like(good), bad, "w")


def test_a_cast_that_overflows_is_refused_as_beyond_the_range():
    src = torch.tensor([1.0, 7e4], dtype=torch.float32)  # float16 holds at most 65504
    with pytest.raises(WeightUpdateError, match=r"holds 7e\+04, beyond float16's largest value"):
        copy_weight(torch.empty(2, dtype=torch.float16), src, "w")
    wide = torch.tensor([1.0, 3.0e38], dtype=torch.float32)  # rounding into bfloat16 is fine
    dst = torch.empty(2, dtype=torch.bfloat16)
    copy_weight(dst, wide, "w")
    assert torch.equal(dst, wide.to(torch.bfloat16))


def test_a_refused_weight_leaves_the_parameter_and_its_spare_buffer(tiny_model_factory):
    """With rollback, the copy goes to the spare buffer first: a refusal touches no live weight."""
    from inflight.engine import EngineConfig, LLMEngine
    from inflight.engine.models.loader import iter_safetensors

    model = tiny_model_factory("qwen2")
    engine = LLMEngine(EngineConfig(model=str(model), block_size=4))
    weights = list(iter_safetensors(model))
    engine.begin_weight_update()
    engine.load_weights(weights)
    engine.finish_weight_update()
    name, tensor = weights[0]
    param = dict(engine.model.named_parameters())[engine.model.resolve(name)]
    before, storage = param.detach().clone(), param.data_ptr()
    spare = engine._spare_weights[engine.model.resolve(name)].data_ptr()
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="NaN or inf"):
        engine.load_weights([(name, torch.full_like(tensor, float("nan")))])
    assert param.data_ptr() == storage and torch.equal(param, before)
    assert engine._spare_weights[engine.model.resolve(name)].data_ptr() == spare
    assert engine.abort_weight_update() is True
