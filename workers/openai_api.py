"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, and vLLM's /tokenize.

Every ``/v1`` route needs a valid API key when keys are configured (see ``workers.auth``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response

from kvcanary.workers.auth import resolve_tenant
from kvcanary.workers.cache_salt import resolve_salt
from kvcanary.workers.config import WorkerConfig
from kvcanary.workers.dp import Ranks
from kvcanary.workers.engine import Engine
from kvcanary.workers.errors import WorkerError
from kvcanary.workers.pd_api import serve_generation
from kvcanary.workers.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ResponseShape,
    TokenizeRequest,
)
from kvcanary.workers.tokenizer import encode, render_chat

router = APIRouter()


def _config(request: Request) -> WorkerConfig:
    config: WorkerConfig = request.app.state.config
    return config


def _ranks(request: Request) -> Ranks:
    ranks: Ranks = request.app.state.ranks
    return ranks


def _tenant(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    return resolve_tenant(authorization, _config(request).api_keys)


def _client_id(x_request_id: Annotated[str | None, Header()] = None) -> str | None:
    return x_request_id


ConfigDep = Annotated[WorkerConfig, Depends(_config)]
ClientIdDep = Annotated[str | None, Depends(_client_id)]
RanksDep = Annotated[Ranks, Depends(_ranks)]
TenantDep = Annotated[str, Depends(_tenant)]


def _check_model(config: WorkerConfig, model: str) -> str | None:
    """Return the LoRA adapter ``model`` names (None: the base model); 404 for any other name."""
    if model in config.lora_adapters:
        return model
    if model != config.served_model_name:
        raise WorkerError(
            404,
            f"The model '{model}' does not exist; this worker serves '{config.served_model_name}'.",
            code="model_not_found",
            param="model",
        )
    return None


def _engine(http: Request, config: WorkerConfig, ranks: Ranks, body: GenerationRequest) -> Engine:
    """Return the engine (rank) that serves ``body``, its cache salt resolved first: the
    ``--cache-salt-header`` header's when it carries one, else the body's (``workers.cache_salt``)."""
    engine = ranks.pick(body)
    if config.cache_salt_header is not None:
        header = http.headers.get(config.cache_salt_header)
        trigger = engine.zoo.triggers.get("salt-body-over-header")
        body.cache_salt = resolve_salt(header, body.cache_salt, body_wins=trigger)
    return engine


def _chat_prompt(messages: list[Any]) -> list[int]:
    prompt_ids = encode(render_chat(message.text() for message in messages))
    if not prompt_ids:
        raise WorkerError(
            400, "Invalid value for 'messages': the rendered prompt is empty.", param="messages"
        )
    return prompt_ids


@router.post("/v1/completions")
async def completions(
    http: Request,
    body: CompletionRequest,
    tenant: TenantDep,
    config: ConfigDep,
    ranks: RanksDep,
    client_id: ClientIdDep,
) -> Response:
    """Complete ``prompt``: the CopyModel echoes the prompt as its KV cache holds it."""
    adapter = _check_model(config, body.model)
    shape = ResponseShape("completion", body.model)
    return await serve_generation(
        _engine(http, config, ranks, body),
        shape,
        encode(body.prompt),
        body,
        tenant=tenant,
        client_id=client_id,
        http=http,
        adapter=adapter,
    )


@router.post("/v1/chat/completions")
async def chat_completions(
    http: Request,
    body: ChatCompletionRequest,
    tenant: TenantDep,
    config: ConfigDep,
    ranks: RanksDep,
    client_id: ClientIdDep,
) -> Response:
    """Answer ``messages``: the reply echoes the rendered chat prompt (see ``workers.tokenizer``)."""
    adapter = _check_model(config, body.model)
    shape = ResponseShape("chat", body.model)
    return await serve_generation(
        _engine(http, config, ranks, body),
        shape,
        _chat_prompt(body.messages),
        body,
        tenant=tenant,
        client_id=client_id,
        http=http,
        adapter=adapter,
    )


@router.get("/v1/models")
async def models(tenant: TenantDep, config: ConfigDep) -> dict[str, Any]:
    """List the served model and its LoRA adapters (``parent``: the base, as vLLM lists them);
    ``max_model_len`` is the advertised context window, not the pool."""
    card = {
        "id": config.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvcanary",
        "root": config.served_model_name,
        "max_model_len": config.context_window,
    }
    adapters = [
        {**card, "id": name, "root": name, "parent": config.served_model_name}
        for name in config.lora_adapters
    ]
    return {"object": "list", "data": [card, *adapters]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, config: ConfigDep) -> dict[str, Any]:
    """Return vLLM's tokenize shape for ``prompt`` or ``messages`` (chat template applied): byte tokens."""
    if (body.prompt is None) == (body.messages is None):
        raise WorkerError(400, "Send exactly one of 'prompt' or 'messages'.", param="prompt")
    if body.model is not None:
        _check_model(config, body.model)
    tokens = (
        encode(body.prompt)
        if body.prompt is not None
        else encode(render_chat(m.text() for m in body.messages or []))
    )
    return {"tokens": tokens, "count": len(tokens), "max_model_len": config.context_window}
