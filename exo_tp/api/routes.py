"""The public HTTP API of a node: OpenAI-compatible generation (and Anthropic's Messages API),
model, cluster and plan views.

Every node serves it. Generation runs on the leader (its worker is rank 0); other nodes pass
generation requests through to the leader unchanged, streaming included. Every response carries
an ``x-request-id`` (the client's own, when it sent a usable one).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from yarl import URL

from exo_tp.api import finetune_api
from exo_tp.api.anthropic import api as anthropic_api
from exo_tp.api.backend import Backend
from exo_tp.api.core.errors import ANTHROPIC_PATHS, ApiError, api_path, shaped_body
from exo_tp.api.core.generation_request import DEFAULT_MODEL_ALIAS
from exo_tp.api.core.left_out import tag as tag_left_out
from exo_tp.api.core.refusals import REFUSAL, log_refusal
from exo_tp.api.guard import install_guard
from exo_tp.api.http_io import MAX_BODY, json_view, off_loop, read_body, validate
from exo_tp.api.model_list import ModelList
from exo_tp.api.ollama import api as ollama_api
from exo_tp.api.ollama import embed as ollama_embed
from exo_tp.api.openai import api as openai_api
from exo_tp.api.openai import embeddings as openai_embeddings
from exo_tp.api.proxy import Upstream, pass_through
from exo_tp.api.responses import api as responses_api
from exo_tp.api.server_limits import body_deadline
from exo_tp.security.access import ApiAccess

log = logging.getLogger(__name__)

BACKEND_KEY = web.AppKey("backend", object)
REQUEST_ID = "x-request-id"
_USABLE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def error_response(error: ApiError, request: web.Request | None = None) -> web.Response:
    if request is not None:
        request[REFUSAL] = error  # for the refusal's log line (exo_tp.api.core.refusals)
    if request is not None and api_path(request.path).startswith(ollama_api.OLLAMA_PREFIX):
        return ollama_api.ollama_error(error)
    body = shaped_body(request.path, error) if request is not None else error.body()
    return web.json_response(body, status=error.status, headers=error.headers())


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves as OpenAI-style JSON (Anthropic's on its paths); the node keeps
    serving."""
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error, request)
    except web.HTTPException as http:
        if http.status < 400:
            raise
        code = {
            404: "not_found",
            405: "method_not_allowed",
            408: "request_timeout",
            413: "request_too_large",
        }
        return error_response(
            ApiError(http.status, http.reason or "error", code=code.get(http.status)), request
        )
    except Exception:  # our bug, not the client's: a 500, and the traceback in the log
        log.exception("internal error on %s", request.path)
        return error_response(ApiError(500, "internal server error", kind="server_error"), request)


def request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a plain token, else a new one (per request)."""
    known = request.get(REQUEST_ID)
    if known is None:
        sent = request.headers.get(REQUEST_ID, "")
        known = sent if _USABLE_ID.fullmatch(sent) else f"req_{uuid.uuid4().hex}"
        request[REQUEST_ID] = known
    return known


async def _tag_response(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID not in response.headers:  # a leader's answer passed through keeps its own
        response.headers[REQUEST_ID] = request_id(request)
    if api_path(request.path) in ANTHROPIC_PATHS and "request-id" not in response.headers:
        response.headers["request-id"] = response.headers[REQUEST_ID]
    tag_left_out(request, response)


def _too_large() -> ApiError:
    return ApiError(413, f"request body larger than {MAX_BODY} bytes", code="request_too_large")


def build_public_app(
    backend: Backend,
    extra_routes: web.RouteTableDef,
    access: ApiAccess | None = None,
    body_timeout: float = 0.0,
) -> web.Application:
    """The public API. ``body_timeout``: seconds a request body may take to arrive (0: no
    limit); it is read after the API key is checked, so no anonymous body is ever waited for."""
    app = web.Application(client_max_size=MAX_BODY, middlewares=[json_errors])
    install_guard(app, access or ApiAccess())
    app.middlewares.append(body_deadline(body_timeout, _too_large))
    app[BACKEND_KEY] = backend
    app.on_response_prepare.append(_tag_response)
    app.on_response_prepare.append(log_refusal)
    app.add_routes(ROUTES)
    app.add_routes(extra_routes)
    return app


def _node(request: web.Request) -> Backend:
    return request.app[BACKEND_KEY]  # type: ignore[return-value]


def _view(view: BaseModel) -> web.Response:
    return web.json_response(view.model_dump(mode="json"))


ROUTES = web.RouteTableDef()


@ROUTES.get("/health")
async def health(request: web.Request) -> web.Response:
    return _view(_node(request).health())


@ROUTES.get("/v1/models")
@ROUTES.get("/models")
async def models(request: web.Request) -> web.Response:
    return json_view(ModelList(object="list", data=_node(request).models_view()))


@ROUTES.get("/v1/models/catalog")
async def model_catalog(request: web.Request) -> web.StreamResponse:
    """The web UI's model picker (any member knows the others' offers and devices)."""
    return _view(await off_loop(_node(request).model_catalog))


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=300)


async def _on_named_model(
    request: web.Request, act: Callable[[Backend, str], Awaitable[BaseModel]]
) -> web.StreamResponse:
    """``act`` on the leader with the model a ``{"model": NAME}`` body names; its answer."""

    async def answer(node: Backend, request: web.Request) -> web.StreamResponse:
        body = validate(LoadRequest, await read_body(request))
        return _view(await act(node, body.model))

    return await _on_leader(request, answer)


@ROUTES.post("/v1/models/load")
async def load_model(request: web.Request) -> web.StreamResponse:
    """Load a model as a request naming it would (downloading a hub id first)."""
    return await _on_named_model(request, lambda node, name: node.load_model(name))


@ROUTES.post("/v1/models/unload")
async def unload_model(request: web.Request) -> web.StreamResponse:
    """Let the served model go now (Ollama's ``keep_alive: 0``); a request loads it again."""
    return await _on_named_model(request, lambda node, name: node.unload_model(name))


@ROUTES.get("/v1/models/{model_id:.+}")
@ROUTES.get("/models/{model_id:.+}")
async def model(request: web.Request) -> web.Response:
    cards = _node(request).models_view()
    wanted = request.match_info["model_id"]
    for card in cards:
        if card.id == wanted or (wanted == DEFAULT_MODEL_ALIAS and card.loaded):
            return json_view(card)
    listed = ", ".join(f"'{c.id}'" for c in cards) or "none yet"
    raise ApiError(
        404,
        f"The model '{wanted[:200]}' does not exist; this cluster serves: {listed}.",
        param="model",
        code="model_not_found",
    )


@ROUTES.get("/v1/cluster")
async def cluster(request: web.Request) -> web.Response:
    return _view(_node(request).cluster_view())


@ROUTES.get("/v1/plan")
async def plan(request: web.Request) -> web.Response:
    return _view(await _node(request).plan_view())


Generation = Callable[[Backend, web.Request], Awaitable[web.StreamResponse]]


async def _on_leader(request: web.Request, generation: Generation) -> web.StreamResponse:
    """Run a generation endpoint here when this node runs generation, else pass it on."""
    node = _node(request)
    upstream = node.generation_upstream()
    if upstream is not None:
        return await _pass_to_leader(request, upstream)
    return await generation(node, request)


@ROUTES.post("/v1/chat/completions")
@ROUTES.post("/chat/completions")  # mlx_lm.server's un-prefixed alias
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, openai_api.chat_completions)


@ROUTES.post("/v1/completions")
@ROUTES.post("/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, openai_api.completions)


@ROUTES.post("/v1/responses")
@ROUTES.post("/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, responses_api.responses)


@ROUTES.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, anthropic_api.messages)


@ROUTES.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, anthropic_api.count_tokens)


# ---- Ollama's API (a third dialect over the same generation path) ---------------------------


@ROUTES.get("/api/version")
async def ollama_version(request: web.Request) -> web.Response:
    return await ollama_api.version(request)


@ROUTES.get("/api/tags")
async def ollama_tags(request: web.Request) -> web.Response:
    return ollama_api.tags(_node(request))


@ROUTES.get("/api/ps")
async def ollama_ps(request: web.Request) -> web.Response:
    return ollama_api.ps(_node(request))


@ROUTES.post("/api/show")
async def ollama_show(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, ollama_api.show)


@ROUTES.post("/api/chat")
async def ollama_chat(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, ollama_api.chat)


@ROUTES.post("/api/generate")
async def ollama_generate(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, ollama_api.generate)


# ---- embeddings of the served model (exo_tp.api.core.embedding) -----------------------------


@ROUTES.post("/v1/embeddings")
@ROUTES.post("/embeddings")
async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, openai_embeddings.embeddings)


async def _ollama_embed(node: Backend, request: web.Request) -> web.StreamResponse:
    return await ollama_embed.embed_route(node, request, legacy=False)


async def _ollama_embeddings(node: Backend, request: web.Request) -> web.StreamResponse:
    return await ollama_embed.embed_route(node, request, legacy=True)


@ROUTES.post("/api/embed")
async def ollama_embed_route(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, _ollama_embed)


@ROUTES.post("/api/embeddings")
async def ollama_embeddings_route(request: web.Request) -> web.StreamResponse:
    return await _on_leader(request, _ollama_embeddings)


finetune_api.add_routes(ROUTES, _node)  # type: ignore[arg-type]


# ---- other modalities: a 404 that says so, not a bare "Not Found" ---------------------------

NOT_SERVED = {
    "/v1/images/generations": "image generation",
    "/v1/audio/speech": "speech",
    "/v1/moderations": "moderation",
}


def _not_served(what: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def route(request: web.Request) -> web.StreamResponse:
        raise ApiError(
            404,
            f"{what} is not served: this cluster serves a text-generation model "
            f"('{_node(request).model}') through chat, completions, responses and messages",
            code="unsupported_endpoint",
        )

    return route


for _path, _what in NOT_SERVED.items():
    ROUTES.post(_path)(_not_served(_what))


async def _pass_to_leader(request: web.Request, upstream: Upstream) -> web.StreamResponse:
    body = await read_body(request)  # malformed bodies are refused here already
    url = upstream.url + api_path(request.path)
    data = json.dumps(body).encode()
    # Signed for the leader's cluster listener: public clients can never crowd it out.
    headers = {
        REQUEST_ID: request_id(request),
        **_node(request).forward_headers(URL(url).path, data),
    }
    return await pass_through(request, upstream.node, url, data, headers)
