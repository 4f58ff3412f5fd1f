"""`GET /v1/models/{id}` over vLLM (which lists its models at `/v1/models` but has no route for one):
the model card vLLM lists under that id, or a 404 with an OpenAI-style body naming `model`, as the
native server answers (the official client's `models.retrieve`). Behind the API key when one is set."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from .control import bearer
from .errors import APIError


def build_models_router(app: Any, *, api_key: str | None) -> APIRouter:
    """The route, reading vLLM's own model list from `app.state.openai_serving_models`."""
    router = APIRouter()

    @router.get("/v1/models/{model_id:path}", dependencies=[Depends(bearer(api_key, "API key", 401))])
    async def model(model_id: str) -> dict[str, Any]:
        listed = (await app.state.openai_serving_models.show_available_models()).model_dump()["data"]
        for card in listed:
            if card["id"] == model_id:
                return card
        names = ", ".join(f"`{card['id']}`" for card in listed)
        raise APIError(
            404,
            f"the model `{model_id}` does not exist; this server serves {names}",
            param="model",
            code="model_not_found",
        )

    return router


__all__ = ["build_models_router"]
