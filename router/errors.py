"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Status rule of the router (one rule for every endpoint):
- 400 for every request the router will not serve as sent: malformed JSON, a body that is
  not an object, a wrong type, an unknown enum value, an out-of-range number, an empty prompt
  or message list, a token id outside the vocabulary, `n > 1`, and a prompt plus
  `max_tokens` beyond the context (`code: "context_length_exceeded"`). No 422 is used.
- 401 missing or wrong API key; 404 unknown path, or a `model` that no live engine serves
  (`model_not_found`, as OpenAI); 405 wrong method; 413 body over the size limit.
- 502 an engine failed (its heartbeats stopped, a malformed reply, an error it reported);
  504 an engine sent nothing within the request timeout; 503 (with `Retry-After`) no live
  engine, or every engine asked reported itself unavailable.
- P/D requests (after their retries): 502 `restore_failed` (decode could not restore its
  prefix, also with `reuse=False`) and `prefill_*` codes when the prefill engine failed
  (`prefill_lost`, `prefill_error`; 400 `prefill_rejected`); 504 `kv_transfer_timeout`
  (decode never got the KV). Decode-side failures keep the `engine_*` codes.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

CLIENT_ERROR = "invalid_request_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """Raised anywhere in request handling; the middleware turns it into a JSON response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return SERVER_ERROR if self.status >= 500 else CLIENT_ERROR

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, extra: dict[str, Any] | None = None) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        body = self.body() | (extra or {})
        return json_response(body, status=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, headers=headers, content_type="application/json"
    )
