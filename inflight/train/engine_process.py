"""TRANSITIONAL (delete when the issue-16 packages merge): train/trainer.py still imports these
from here; they live in `inflight.client.process`, and `engine_stats` is `client.stats()`."""

from inflight.client.base import InferenceClient
from inflight.client.process import EngineProcess, EngineProcessError, ProcessClient, ReceiverSpec

__all__ = ["EngineProcess", "EngineProcessError", "ProcessClient", "ReceiverSpec", "engine_stats"]


async def engine_stats(client: InferenceClient) -> dict[str, int]:
    """The engines' counters ({} when they report none)."""
    return await client.stats()
