"""ASGI middleware that puts every vLLM route except health probes behind the run's admin token.

vLLM's own `--api-key` / `VLLM_API_KEY` only guards `/v1/...`; the RL admin routes (`/pause`,
`/resume`, `/collective_rpc`, `/abort_requests`, ...) stay open with it. vLLM loads this class via
`--middleware rlctl.inference.auth.AdminAuthMiddleware` and instantiates it without arguments, so
the token comes from the same environment variable vLLM reads (`VLLM_API_KEY`), never argv.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os

TOKEN_ENV = "VLLM_API_KEY"
# Probes that load balancers and the router call without credentials; they reveal nothing.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class AdminAuthMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"{TOKEN_ENV} is not set: refusing to serve admin routes without a token")
        self._digest = hashlib.sha256(token.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, param = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                return hmac.compare_digest(hashlib.sha256(param.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
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
