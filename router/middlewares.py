"""The app's middlewares, outermost first: errors (every error as an OpenAI-style body, every
response counted), body (read within --read-timeout, the connection marked as serving), auth
(the request's key against what its path needs)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from router import keys
from router.auth import ANONYMOUS
from router.errors import ApiError
from router.server import GUARD, read_body

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes: no key, not counted
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before the answer


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-style JSON body; every response but /health's and
    /metrics' (polls) is counted. A client that left mid-request (an aborted upload) is
    a client error, 499 as nginx counts it, with one debug line and no traceback."""
    try:
        resp = await handler(request)
    except ApiError as e:
        resp = e.response()
    except web.HTTPException as e:
        resp = _http_error(e)
    except (ConnectionResetError, RequestPayloadError) as e:
        log.debug("client left during %s %s: %r", request.method, request.path, e)
        resp = ApiError(CLIENT_CLOSED, "client closed the request", code="client_closed").response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        resp = ApiError(500, "internal error", code="internal_error").response()
    if request.path not in OPEN_PATHS:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        metrics = request.app[keys.METRICS]
        metrics.child(metrics.requests, endpoint, str(resp.status)).inc()
    return resp


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the body within --read-timeout (408 and the connection closed when it is too
    slow), then mark the connection as serving (never evicted, `router.server`)."""
    config, guard = request.app[keys.CONFIG], request.app.get(GUARD)
    if request.body_exists:
        try:
            await read_body(request, config.read_timeout_s)
        except TimeoutError:
            request.app[keys.METRICS].connections_closed.labels("read_timeout").inc()
            raise ApiError(
                408,
                f"the request body did not arrive within {config.read_timeout_s:g} s",
                code="request_timeout",
            ) from None
        except web.HTTPRequestEntityTooLarge as e:
            raise ApiError(
                413, f"request body too large: {e.text}", code="body_too_large"
            ) from None
    if guard is None:
        return await handler(request)
    guard.serving(request.protocol)
    try:
        return await handler(request)
    finally:
        guard.done(request.protocol)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's key, checked against what its path needs (router/auth.py): 401 for a
    missing or wrong key, 403 for a valid key that is not the admin key on an admin path."""
    ring = request.app[keys.KEYRING]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    identity = ring.identify(token.strip() if scheme.lower() == "bearer" else None)
    need = ring.required(request.path)
    if need != "none" and identity is None:
        raise ApiError(401, "missing or incorrect API key", code="invalid_api_key")
    if need == "admin" and identity is not None and not identity.admin:
        raise ApiError(403, "this endpoint needs the admin API key", code="permission_denied")
    request[keys.IDENTITY] = identity or ANONYMOUS
    return await handler(request)


def _http_error(e: web.HTTPException) -> web.Response:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
    err = ApiError(e.status, e.reason if e.status != 413 else e.text or e.reason)
    err.code = codes.get(e.status, "http_error")
    resp = err.response()
    if "Allow" in e.headers:
        resp.headers["Allow"] = e.headers["Allow"]
    return resp
