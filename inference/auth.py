"""ASGI middleware that puts every vLLM route except health probes behind one of the run's two keys.

- the *api key* opens the OpenAI routes (`/v1/...`) only; it is the one credential the orchestrator
  sends through the router, so a worker slipped into the router can learn nothing more than it;
- the *admin token* opens everything: the RL admin routes (`/pause`, `/resume`, `/collective_rpc`,
  `/abort_requests`, ...) and every other route. It only ever travels from the orchestrator to a
  server's own URL, never through the router.

vLLM's own `--api-key` only guards `/v1/...`, so it cannot express this. vLLM loads this class via
`--middleware rlctl.inference.auth.AdminAuthMiddleware` and instantiates it without arguments: both
keys come from the environment (never argv). `VLLM_API_KEY` is set empty so that a value inherited
from the user's shell cannot switch vLLM's own check on with a foreign key.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath

ADMIN_TOKEN_ENV = "RLCTL_ADMIN_TOKEN"
API_KEY_ENV = "RLCTL_API_KEY"
# Probes that load balancers and the router call without credentials; they reveal nothing.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
OPENAI_PREFIX = "/v1/"
# Under /v1 but they change what the server serves (LoRA adapter swaps): the admin token only.
ADMIN_ONLY_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def bearer(scope) -> str | None:
    """The bearer credential of the request, or None (no or another Authorization scheme)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, param = value.decode("latin-1").partition(" ")
            return param.strip() if scheme.lower() == "bearer" else None
    return None


def is_openai_route(path: str) -> bool:
    """`/v1/...` as routed, i.e. without dot segments or doubled slashes that could resolve elsewhere."""
    return path.startswith(OPENAI_PREFIX) and posixpath.normpath(path) == path.rstrip("/")


class AdminAuthMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        keys = {name: os.environ.get(name, "") for name in (ADMIN_TOKEN_ENV, API_KEY_ENV)}
        missing = [name for name, value in keys.items() if not value]
        if missing:
            raise RuntimeError(f"{' and '.join(missing)} not set: refusing to serve without the run's keys")
        if keys[ADMIN_TOKEN_ENV] == keys[API_KEY_ENV]:
            raise RuntimeError(f"{ADMIN_TOKEN_ENV} equals {API_KEY_ENV}: the two keys must differ")
        self._admin = _digest(keys[ADMIN_TOKEN_ENV])
        self._api = _digest(keys[API_KEY_ENV])

    def allowed(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        given = bearer(scope)
        if not given:
            return False
        digest = _digest(given)
        # Both comparisons always run: timing does not tell which key a guess was close to.
        admin = hmac.compare_digest(digest, self._admin)
        api = hmac.compare_digest(digest, self._api)
        return admin or (api and is_openai_route(path) and path.rstrip("/") not in ADMIN_ONLY_ROUTES)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        if self.allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
