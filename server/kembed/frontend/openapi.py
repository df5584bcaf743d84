"""The REST port described: an OpenAPI 3.1 document (``GET /openapi.json``) and the same as a page
(``GET /docs``), built from what the parser reads (:data:`~kembed.frontend.openai_api.BODY`,
:func:`~kembed.frontend.openai_api.input_schema` under this server's limits) and from :data:`ROUTES`,
the route table ``rest.py`` serves. A route, a field or a limit cannot be added to one and not the
other. The page is plain HTML, built here: it loads nothing, so it reads the same offline.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import orjson

from kembed import __version__
from kembed.config.settings import Settings
from kembed.frontend.call import Limits
from kembed.frontend.openai_api import BODY, input_schema

EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"
TOKENIZE_PATH = "/tokenize"  # where TEI and vLLM answer it
OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
JSON = "application/json"
HTML = "text/html; charset=utf-8"
_REF = "#/components/schemas/"
_BEARER = "apiKey"


@dataclass(frozen=True)
class Route:
    """A route of the REST port: what it takes (the embeddings body, or nothing) and answers."""

    path: str
    method: str
    summary: str
    answer: str  # its 200 answer's schema in the document's components, or "" for a page
    body: bool = False  # takes the embeddings body
    public: bool = False  # served without an API key: it describes the API

    @property
    def operation_id(self) -> str:
        return self.method.lower() + self.path.replace("/", "_").replace(".", "_")


ROUTES = (
    Route(
        EMBEDDINGS_PATH,
        "POST",
        "Embed the inputs (OpenAI's embeddings API, with kembed's extensions)",
        "Embeddings",
        True,
    ),
    Route(
        TOKENIZE_PATH,
        "POST",
        "Each input's token ids as /v1/embeddings computes them: nothing is embedded",
        "Tokens",
        True,
    ),
    Route(MODELS_PATH, "GET", "The model names this server answers to, with the model's prompts", "Models"),
    Route(OPENAPI_PATH, "GET", "This document: OpenAPI 3.1", "", public=True),
    Route(DOCS_PATH, "GET", "This document as a page (HTML, loads nothing)", "", public=True),
)
# A body route's failures: status, and when (docs/api.md, "Errors").
FAILURES = {
    400: "Bad input, named by `param` (`input[3]`, `input[1][4]`, a field)",
    401: "No API key, or not one of the server's (with KEMBED_API_KEY_FILE)",
    404: "A `model` this server does not serve",
    408: "The body did not arrive in time",
    413: "The body is over KEMBED_MAX_MESSAGE_BYTES",
    415: "Not `application/json`, or compressed",
    429: "Refused by admission: retry after `retry-after-ms` (or `Retry-After`, seconds)",
    500: "The model failed on this request's inputs",
    503: "Warming up or draining: retry, on another replica if there is one",
    504: "Its deadline passed before it was computed",
}
_STRING, _INTEGER, _NULLABLE = {"type": "string"}, {"type": "integer"}, {"type": ["string", "null"]}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """A JSON object that has every one of these properties (the answers write each)."""
    return {"type": "object", "required": list(properties), "properties": properties}


def _list(kind: str, item: dict[str, Any], **more: Any) -> dict[str, Any]:
    """OpenAI's list answer: ``{"object": "list", "data": [{"object": kind, ...item}], ...more}``."""
    items = _object({"object": {"const": kind}, **item})
    return _object({"object": {"const": "list"}, "data": {"type": "array", "items": items}, **more})


_USAGE = _object({"prompt_tokens": _INTEGER, "total_tokens": _INTEGER})
_EMBEDDING = {
    "description": "float: numbers; base64: float32's little-endian bytes; the quantized kinds: integers",
    "oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string", "contentEncoding": "base64"}],
}
_CHUNKS = {
    "description": "The ids of each chunk (one, unless the input was chunked)",
    "type": "array",
    "items": {"type": "array", "items": _INTEGER},
}
_SCHEMAS: dict[str, Any] = {
    "Embeddings": _list("embedding", {"index": _INTEGER, "embedding": _EMBEDDING}, model=_STRING, usage=_USAGE),
    "Tokens": _list("tokens", {"index": _INTEGER, "tokens": _CHUNKS, "count": _INTEGER}, model=_STRING, usage=_USAGE),
    "Models": _list(
        "model",
        {
            "id": _STRING,
            "created": _INTEGER,
            "owned_by": _STRING,
            "prompts": {"type": "object", "additionalProperties": _STRING},
            "default_prompt_name": _NULLABLE,
        },
    ),
    "Error": _object({"error": _object({"message": _STRING, "type": _STRING, "param": _NULLABLE, "code": _NULLABLE})}),
}


def body_schema(limits: Limits) -> dict[str, Any]:
    """The embeddings body under ``limits``: ``input``, then every field of :data:`BODY`, each of
    which may be null (the same as absent); no other field."""
    properties: dict[str, Any] = {"input": input_schema(limits)}
    for field in BODY:
        described = {"description": field.description + (" (kembed's)" if field.extension else "")}
        if field.default is not None:
            described["default"] = field.default
        properties[field.name] = {**described, "anyOf": [field.schema, {"type": "null"}]}
    return {"type": "object", "required": ["input"], "additionalProperties": False, "properties": properties}


def document(settings: Settings, keys: bool) -> dict[str, Any]:
    """The OpenAPI document of a server with these settings; ``keys``: it requires an API key."""
    paths: dict[str, Any] = {}
    for route in ROUTES:
        paths[route.path] = {route.method.lower(): _operation(route, keys)}
    components: dict[str, Any] = {"schemas": {**_SCHEMAS, "EmbeddingsBody": body_schema(Limits.of(settings))}}
    if keys:
        components["securitySchemes"] = {_BEARER: {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kembed",
            "version": __version__,
            "description": "The OpenAI embeddings API and kembed's extensions (docs/api.md). Every field but "
            f"input may be null, which is the same as absent; at most {settings.max_items_per_request} inputs "
            f"a request, a body of at most {settings.max_message_bytes} bytes.",
        },
        "paths": paths,
        "components": components,
    }


def _operation(route: Route, keys: bool) -> dict[str, Any]:
    operation: dict[str, Any] = {"operationId": route.operation_id, "summary": route.summary}
    if route.body:
        content = {JSON: {"schema": {"$ref": _REF + "EmbeddingsBody"}}}
        operation["requestBody"] = {"required": True, "content": content}
    if route.answer:
        answered = {"content": {JSON: {"schema": {"$ref": _REF + route.answer}}}}
    else:
        answered = {"content": {JSON if route.path == OPENAPI_PATH else "text/html": {}}}
    responses: dict[str, Any] = {"200": {"description": "The answer", **answered}}
    failures = {status: when for status, when in FAILURES.items() if route.body or status == 401}
    if route.public or not keys:
        failures.pop(401)
    for status, when in failures.items():
        responses[str(status)] = {"description": when, "content": {JSON: {"schema": {"$ref": _REF + "Error"}}}}
        if status == 429:
            responses["429"]["headers"] = {
                "retry-after-ms": {"schema": {"type": "integer"}, "description": "When to retry, in milliseconds"},
                "Retry-After": {"schema": {"type": "integer"}, "description": "When to retry, in seconds"},
            }
    operation["responses"] = responses
    operation["security"] = [] if route.public or not keys else [{_BEARER: []}]
    return operation


def serialized(settings: Settings, keys: bool) -> tuple[bytes, bytes]:
    """The document as JSON, and as a page: what the two routes answer."""
    doc = document(settings, keys)
    return orjson.dumps(doc), page(doc).encode()


def page(doc: dict[str, Any]) -> str:
    """The document as one HTML page: each route, and the body's fields with their schemas."""
    esc = html.escape
    routes = "".join(
        f"<tr><td><code>{esc(method.upper())}</code></td><td><code>{esc(path)}</code></td>"
        f"<td>{esc(operation['summary'])}</td><td>{esc(', '.join(operation['responses']))}</td></tr>"
        for path, item in doc["paths"].items()
        for method, operation in item.items()
    )
    body = doc["components"]["schemas"]["EmbeddingsBody"]
    fields = "".join(
        f"<tr><td><code>{esc(name)}</code>{' (required)' if name in body['required'] else ''}</td>"
        f"<td>{esc(schema.get('description', ''))}</td>"
        f"<td><code>{esc(orjson.dumps(_without(schema, 'description')).decode())}</code></td></tr>"
        for name, schema in body["properties"].items()
    )
    info = doc["info"]
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(info['title'])} {esc(info['version'])}: the REST API</title>"
        "<style>body{font-family:sans-serif;max-width:72em;margin:auto}td{vertical-align:top;padding:.2em .5em}"
        "table{border-collapse:collapse}tr:nth-child(even){background:#f3f3f3}code{font-size:90%}</style></head>"
        f"<body><h1>{esc(info['title'])} {esc(info['version'])}</h1><p>{esc(info['description'])}</p>"
        f'<p>The machine-readable document: <a href="{OPENAPI_PATH}">{OPENAPI_PATH}</a> (OpenAPI 3.1).</p>'
        "<h2>Routes</h2><table><tr><th>Method</th><th>Path</th><th>What it does</th><th>Answers</th></tr>"
        f"{routes}</table><h2>The body of POST {EMBEDDINGS_PATH} and {TOKENIZE_PATH}</h2>"
        f"<table><tr><th>Field</th><th>Meaning</th><th>JSON Schema</th></tr>{fields}</table></body></html>"
    )


def _without(schema: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != key}
