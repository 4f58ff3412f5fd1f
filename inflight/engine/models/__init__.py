"""Model families and loading from a local Hugging Face directory."""

from inflight.engine.models.loader import ARCHITECTURES, load_model

__all__ = ["ARCHITECTURES", "load_model"]
