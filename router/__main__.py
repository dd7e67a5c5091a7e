"""`python -m router`: the HTTP front of the mesh.

    python -m router --port 8000 --nats-url nats://127.0.0.1:4222 \\
        --redis-url redis://127.0.0.1:6379/0 [--api-key-file FILE] \\
        [--admin-api-key-file FILE] [--tenant-keys FILE] [--hide-cache-stats] [--record FILE] \\
        [--request-timeout S] [--bucket NAME[:max_len=N] ...] \\
        [--pd-admit-timeout S] [--pd-transfer-timeout S] [--read-timeout S] \\
        [--max-connections N] [--max-prompt-chars N] [--tokenizer-worker-num N] \\
        [--tokenize-timeout S]

SIGINT/SIGTERM stop it gracefully: it stops accepting, lets in-flight requests finish (for
at most --shutdown-timeout seconds), drains NATS and closes Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web

from bus_schemas.connection import (
    Credentials,
    add_nats_url_arg,
    add_tls_args,
    read_credentials,
    tls_ca_file,
)
from bus_schemas.sentinel import add_sentinel_args, parse_sentinels, sentinel_redis_url
from router.app import init
from router.auth import PROBE_AUTH, load_tenant_keys
from router.buckets import DEFAULT, parse_bucket
from router.config import RouterConfig
from router.record import TOKEN_IDS
from router.server import GUARD, GuardedSite, serve_kwargs

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
API_KEY_ENV = "HICACHE_ROUTER_API_KEY"
API_KEY_FILE_ENV = "HICACHE_ROUTER_API_KEY_FILE"
ADMIN_KEY_ENV = "HICACHE_ROUTER_ADMIN_API_KEY"
ADMIN_KEY_FILE_ENV = "HICACHE_ROUTER_ADMIN_API_KEY_FILE"
TENANT_KEYS_ENV = "HICACHE_ROUTER_TENANT_KEYS"
KEY_ON_ARGV = (
    "--api-key on the command line shows in `ps` and /proc/PID/cmdline to every local user: "
    f"it is deprecated; give ${API_KEY_ENV} or --api-key-file FILE instead"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_nats_url_arg(p, "nats://127.0.0.1:4222")
    p.add_argument(
        "--redis-url",
        default=None,
        help="the Redis server (default redis://127.0.0.1:6379/0); with --redis-sentinel only "
        "scheme, credentials and db (default redis:///0)",
    )
    p.add_argument(
        "--nats-credentials",
        metavar="FILE",
        default=None,
        help="NATS `user:password` in a 0600 file (`hicache-mesh credentials` makes them)",
    )
    p.add_argument(
        "--redis-credentials", metavar="FILE", default=None, help="Redis `user:password` (0600)"
    )
    add_tls_args(p, redis=True)
    add_sentinel_args(p)
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}); deprecated on "
        "the command line, where `ps` shows it: give the variable or --api-key-file",
    )
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        default=os.environ.get(API_KEY_FILE_ENV),
        help=f"read the API key from FILE, e.g. a secret (default: ${API_KEY_FILE_ENV})",
    )
    p.add_argument(
        "--admin-api-key-file",
        metavar="FILE",
        default=os.environ.get(ADMIN_KEY_FILE_ENV),
        help="read the admin API key from FILE: then only it opens /flush_cache and /stats "
        f"(it opens every other endpoint too; default: ${ADMIN_KEY_FILE_ENV}, or the key "
        f"itself in ${ADMIN_KEY_ENV})",
    )
    p.add_argument(
        "--tenant-keys",
        metavar="FILE",
        default=os.environ.get(TENANT_KEYS_ENV),
        help="API keys of tenants, one 'KEY TENANT [shared=NS,...]' per line: a tenant's "
        "cache salt is derived from its name, so tenants never share (or see) prefix hits "
        f"unless a request names an allowed shared 'cache_namespace' (default: ${TENANT_KEYS_ENV})",
    )
    p.add_argument(
        "--shared-cache-namespace",
        metavar="NAME",
        action="append",
        default=[],
        help="a 'cache_namespace' every tenant may name (repeat for several)",
    )
    p.add_argument(
        "--probe-auth",
        choices=PROBE_AUTH,
        default="open",
        help="which probes need a key: 'metrics' (/metrics needs the admin key, or any key "
        "without one), 'all' (/health and /ready need a key too); default open",
    )
    p.add_argument(
        "--hide-cache-stats",
        action="store_true",
        help="responses carry no cached-token figures, engine ids or Server-Timing (they tell "
        "whether a prompt prefix was seen before)",
    )
    p.add_argument(
        "--record",
        metavar="FILE",
        default=None,
        help="append the traffic as JSON lines, one per request (docs/recording.md)",
    )
    p.add_argument(
        "--record-redact",
        action="store_true",
        help="records keep only known-safe request fields (sampling numbers), no text",
    )
    p.add_argument(
        "--record-token-ids",
        choices=TOKEN_IDS,
        default="keep",
        help="prompt and output ids in records: keep, hash (keyed digests per page) or drop "
        "(counts only); replay needs keep",
    )
    p.add_argument(
        "--record-max-bytes",
        metavar="N",
        type=int,
        default=1 << 30,
        help="rotate the record file past N bytes (FILE.1, FILE.2, ...; 0: never; default 1 GiB)",
    )
    p.add_argument(
        "--record-backups", metavar="N", type=int, default=3, help="rotated record files kept"
    )
    p.add_argument(
        "--record-queue",
        metavar="N",
        type=int,
        default=10_000,
        help="records waiting for the writer thread; beyond it records are dropped (counted)",
    )
    p.add_argument(
        "--record-meta",
        metavar="JSON",
        default="{}",
        help="what the record header says about the mesh (`hicache-mesh up` sets it)",
    )
    p.add_argument("--request-timeout", metavar="S", type=float, default=30.0)
    p.add_argument(
        "--default-max-tokens",
        metavar="N",
        type=int,
        default=None,
        help="completions and chat without max_tokens generate at most N tokens (default: "
        "up to the context length minus the prompt, as OpenAI)",
    )
    p.add_argument(
        "--bucket",
        action="append",
        metavar="NAME[:max_len=N]",
        help="an engine bucket serving prompt + max_tokens up to N (repeat for several; the "
        "smallest that fits serves; default: one unbounded bucket 'default')",
    )
    p.add_argument(
        "--pd-admit-timeout", metavar="S", type=float, default=10.0, help="P/D: admit wait"
    )
    p.add_argument(
        "--pd-transfer-timeout",
        metavar="S",
        type=float,
        default=None,
        help="P/D: how long decode engines wait for KV (default: 0.8 x --request-timeout)",
    )
    p.add_argument("--shutdown-timeout", metavar="S", type=float, default=30.0)
    p.add_argument(
        "--read-timeout",
        metavar="S",
        type=float,
        default=30.0,
        help="a request's headers, then its body, must arrive within this (else 408/close)",
    )
    p.add_argument(
        "--max-connections",
        metavar="N",
        type=int,
        default=4096,
        help="open client connections; beyond it the oldest non-serving one is closed",
    )
    p.add_argument(
        "--max-prompt-chars",
        metavar="N",
        type=int,
        default=4 * 1024 * 1024,
        help="a text prompt (a chat request's messages together) over N characters, or over "
        "32 per token of the model's context, is refused before tokenizing (400)",
    )
    p.add_argument(
        "--tokenizer-worker-num",
        metavar="N",
        type=int,
        default=2,
        help="worker processes that render chat templates and tokenize prompts",
    )
    p.add_argument(
        "--tokenize-timeout",
        metavar="S",
        type=float,
        default=5.0,
        help="a prompt's rendering and tokenizing must finish in this (else its worker is "
        "killed and the request gets 400)",
    )
    p.add_argument(
        "--refuse-special-tokens",
        action="store_true",
        help="a prompt or message whose text holds a special token's string (e.g. "
        "<|im_end|>) gets 400, instead of being tokenized as that control token",
    )
    p.add_argument(
        "--max-engines",
        metavar="N",
        type=int,
        default=512,
        help="engines tracked from heartbeats; a new engine beyond N is ignored while all "
        "are live (bounds /metrics, /v1/models and routing state)",
    )
    p.add_argument(
        "--max-model-cards",
        metavar="N",
        type=int,
        default=64,
        help="model cards (tokenizer, chat template) held; the least recently used goes first",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return p


def api_key_of(args: argparse.Namespace) -> str | None:
    """The API key: --api-key (or its variable), else the first line of --api-key-file (or
    its variable's file); None for none (an empty value too: `${API_KEY:-}` in compose)."""
    if args.api_key and args.api_key_file:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if not args.api_key_file:
        return args.api_key or None
    return read_key_file("--api-key-file", args.api_key_file)


def admin_key_of(args: argparse.Namespace) -> str | None:
    """The admin key: --admin-api-key-file (or its variable), else $HICACHE_ROUTER_ADMIN_API_KEY."""
    if args.admin_api_key_file:
        return read_key_file("--admin-api-key-file", args.admin_api_key_file)
    return os.environ.get(ADMIN_KEY_ENV) or None


def read_key_file(flag: str, path: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    key = text.strip()
    if not key or "\n" in key:
        raise ValueError(f"{flag} {path}: not one line holding the key")
    return key


def key_on_command_line(argv: list[str]) -> bool:
    """Whether `argv` itself holds --api-key (its variable is fine)."""
    return any(a == "--api-key" or a.startswith("--api-key=") for a in argv)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def open_bind_warning(host: str, config: RouterConfig) -> str | None:
    """The warning for a router that anyone who can reach `host` may use, else None."""
    if is_loopback(host) or config.api_key or config.tenant_keys:
        return None
    admin = "" if config.admin_api_key else ", read /stats and flush the cache"
    return (
        f"the router listens on {host}, beyond loopback, and asks for no API key: anyone who "
        f"reaches it can generate{admin}; give ${API_KEY_ENV}, --api-key-file or --tenant-keys"
    )


def config_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> RouterConfig:
    try:
        meta = json.loads(args.record_meta)
    except json.JSONDecodeError as e:
        raise ValueError(f"--record-meta is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError("--record-meta must be a JSON object")
    sentinels = parse_sentinels(args.redis_sentinel)
    redis_url = args.redis_url or DEFAULT_REDIS_URL
    if sentinels:
        redis_url = sentinel_redis_url(args.redis_url, sentinels)
    return RouterConfig(
        nats_url=args.nats_url,
        redis_url=redis_url,
        redis_sentinels=sentinels,
        redis_sentinel_master=args.redis_sentinel_master,
        redis_sentinel_credentials=_credentials(args.redis_sentinel_credentials),
        nats_credentials=_credentials(args.nats_credentials),
        redis_credentials=_credentials(args.redis_credentials),
        nats_tls_ca_file=tls_ca_file(args.nats_tls_ca_file),
        redis_tls_ca_file=tls_ca_file(args.redis_tls_ca_file),
        api_key=api_key_of(args),
        admin_api_key=admin_key_of(args),
        tenant_keys=load_tenant_keys(args.tenant_keys) if args.tenant_keys else (),
        shared_cache_namespaces=tuple(args.shared_cache_namespace),
        probe_auth=args.probe_auth,
        hide_cache_stats=args.hide_cache_stats,
        record_path=args.record,
        record_redact=args.record_redact,
        record_token_ids=args.record_token_ids,
        record_max_bytes=args.record_max_bytes,
        record_backups=args.record_backups,
        record_queue=args.record_queue,
        record_meta=args.record_meta,
        router_argv=tuple(sys.argv[1:] if argv is None else argv),
        buckets=tuple(parse_bucket(b) for b in args.bucket or [DEFAULT]),
        request_timeout_s=args.request_timeout,
        default_max_tokens=args.default_max_tokens,
        shutdown_timeout_s=args.shutdown_timeout,
        pd_admit_timeout_s=args.pd_admit_timeout,
        pd_transfer_timeout_s=args.pd_transfer_timeout,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
        max_prompt_chars=args.max_prompt_chars,
        tokenizer_worker_num=args.tokenizer_worker_num,
        tokenize_timeout_s=args.tokenize_timeout,
        refuse_special_tokens=args.refuse_special_tokens,
        max_engines=args.max_engines,
        max_model_cards=args.max_model_cards,
    )


def _credentials(path: str | None) -> Credentials | None:
    return None if path is None else read_credentials(path)


async def serve(config: RouterConfig, host: str, port: int, access_log: bool = False) -> None:
    """Run until SIGINT/SIGTERM, then shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = init(config)
    runner = web.AppRunner(
        app,
        shutdown_timeout=config.shutdown_timeout_s,
        access_log=logging.getLogger("aiohttp.access") if access_log else None,
        **serve_kwargs(config),
    )
    if not await _until_stopped(runner.setup(), stop):
        logging.getLogger("router").info("stopped before startup finished")
        return
    try:
        await GuardedSite(runner, host, port, app[GUARD]).start()
        logging.getLogger("router").info("listening on http://%s:%d", host, port)
        await stop.wait()
        logging.getLogger("router").info("stopping")
    finally:
        await runner.cleanup()


async def _until_stopped(startup: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `startup` unless `stop` is set first (then cancel it): True when it finished.

    Startup waits for NATS, which may be down for a long time; SIGTERM must still stop us.
    """
    task = asyncio.create_task(startup, name="router-startup")
    stopped = asyncio.create_task(stop.wait(), name="router-stop-wait")
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # re-raise a startup failure
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = logging.getLogger("router")
    if key_on_command_line(sys.argv[1:] if argv is None else argv):
        log.warning(KEY_ON_ARGV)
    warning = open_bind_warning(args.host, config)
    if warning is not None:
        log.warning("%s", warning)
    import uvloop

    uvloop.run(serve(config, args.host, args.port, args.access_log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
