"""The index's writes to Redis, in the layout of `bus_schemas.redis_keys`.

Every change to one engine's entries is one server-side script call, so a batch costs one
round trip whatever its size, and Redis never shows half a batch: the router's lookup sees
the engine's entries before or after the batch, never in between.
"""

from __future__ import annotations

import ssl
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from bus_schemas import redis_keys
from bus_schemas.connection import Credentials, tls_context
from bus_schemas.messages import KVEvent
from bus_schemas.sentinel import INDEX_SYNCED, Address

PAGE_PREFIX = redis_keys.page("")
HASH_LEN = 32  # 16-byte blake2b digests as hex (bus_schemas/page_hash.py)
_HEX = frozenset(string.hexdigits.lower())

# Apply one engine's ops in order, optionally after dropping all its entries.
# KEYS: engine pages set, engine meta, engine alive, engines set.
# ARGV: engine_id, page key prefix, clear ('1'|'0'), alive ttl ms (set only if absent; '0'
#       leaves it), epoch, seq, bucket, namespace, then (page_hash, signed tier bit) pairs:
#       +bit sets the tier bit, -bit clears it.
# Returns the number of pages the engine holds afterwards.
APPLY_LUA = """
local pages, meta, alive, engines = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local eid, prefix = ARGV[1], ARGV[2]
if ARGV[3] == '1' then
  for _, h in ipairs(redis.call('SMEMBERS', pages)) do
    redis.call('HDEL', prefix .. h, eid)
  end
  redis.call('DEL', pages)
end
for i = 9, #ARGV, 2 do
  local h = ARGV[i]
  local delta = tonumber(ARGV[i + 1])
  local bit = math.abs(delta)
  local key = prefix .. h
  local old = tonumber(redis.call('HGET', key, eid) or '0')
  local has = math.floor(old / bit) % 2 == 1
  local new = old
  if delta > 0 and not has then new = old + bit end
  if delta < 0 and has then new = old - bit end
  if new ~= old then
    if new == 0 then
      redis.call('HDEL', key, eid)
      redis.call('SREM', pages, h)
    else
      redis.call('HSET', key, eid, new)
      if old == 0 then redis.call('SADD', pages, h) end
    end
  end
end
redis.call('HSET', meta, 'epoch', ARGV[5], 'seq', ARGV[6], 'bucket', ARGV[7],
           'namespace', ARGV[8])
redis.call('SADD', engines, eid)
if tonumber(ARGV[4]) > 0 then
  redis.call('SET', alive, ARGV[5], 'PX', ARGV[4], 'NX')
end
return redis.call('SCARD', pages)
"""

# Drop every entry of an engine whose alive key is gone, atomically with the liveness check.
# KEYS: engine pages set, engine meta, engine alive, engines set. ARGV: engine_id, page prefix.
# Returns the number of pages dropped, or -1 when the engine is alive.
EXPIRE_LUA = """
local pages, meta, alive, engines = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local eid, prefix = ARGV[1], ARGV[2]
if redis.call('EXISTS', alive) == 1 then return -1 end
local held = redis.call('SMEMBERS', pages)
for _, h in ipairs(held) do
  redis.call('HDEL', prefix .. h, eid)
end
redis.call('DEL', pages, meta)
redis.call('SREM', engines, eid)
return #held
"""


@dataclass(frozen=True, slots=True)
class EngineMeta:
    """`hc:engine:{id}:meta`. `seq` -1: not in sync (nothing applied yet, or resyncing)."""

    epoch: int
    seq: int
    bucket: str
    namespace: str


def valid_page_hash(page_hash: str) -> bool:
    return len(page_hash) == HASH_LEN and all(c in _HEX for c in page_hash)


def event_ops(events: Sequence[KVEvent]) -> list[tuple[str, int]]:
    """(page_hash, signed tier bit) per page of the engine's own tiers (device, host), in
    event order: +bit stored, -bit removed."""
    ops: list[tuple[str, int]] = []
    for event in events:
        if event.tier not in redis_keys.TIER_BITS:
            continue  # storage: `stored_pages`
        bit = redis_keys.TIER_BITS[event.tier]
        signed = bit if event.kind == "stored" else -bit
        ops.extend((h, signed) for h in event.page_hashes)
    return ops


def stored_pages(events: Sequence[KVEvent]) -> list[str]:
    """Page hashes the events say reached the engine's external store."""
    return [h for e in events if e.tier == "storage" and e.kind == "stored" for h in e.page_hashes]


def _engine_keys(engine_id: str) -> list[str]:
    return [
        redis_keys.engine_pages(engine_id),
        redis_keys.engine_meta(engine_id),
        redis_keys.engine_alive(engine_id),
        redis_keys.ENGINES,
    ]


def connect(
    url: str,
    timeout_s: float,
    credentials: Credentials | None = None,
    tls_ca_file: str | None = None,
) -> aioredis.Redis:
    """A client that fails fast: one immediate retry (a stale pooled connection), then error.
    With `credentials`, it authenticates as their user on every (re)connect. With
    `tls_ca_file` (PEM) it connects over TLS whatever the URL's scheme, verifying the
    server's certificate and host name against that CA (TLSConfigError for a bad file)."""
    tls: dict[str, Any] = {}
    if tls_ca_file is not None:
        scheme, sep, rest = url.partition("://")
        if scheme not in ("redis", "rediss") or not sep:
            raise ValueError(f"a Redis TLS CA file needs a redis:// or rediss:// URL: {url}")
        tls_context(tls_ca_file)  # readable, and PEM: else an error now, not at each call
        url = f"rediss://{rest}"
        tls = {"ssl_ca_certs": tls_ca_file, "ssl_cert_reqs": "required"}
        tls |= {"ssl_check_hostname": True, "ssl_min_version": ssl.TLSVersion.TLSv1_2}
    return aioredis.Redis.from_url(
        url,
        **tls,
        username=None if credentials is None else credentials.user,
        password=None if credentials is None else credentials.password,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )


def connect_sentinel(
    url: str,
    sentinels: Sequence[Address],
    master: str,
    timeout_s: float,
    credentials: Credentials | None = None,
    sentinel_credentials: Credentials | None = None,
    tls_ca_file: str | None = None,
) -> aioredis.Redis:
    """A client of the primary that `sentinels` name `master`, as `connect` makes one: each
    (re)connect asks the sentinels where the primary is, so a failover is followed at the
    next connection (a call on a lost connection fails, or is retried once on the new
    primary). `url` gives scheme, credentials and db only (`bus_schemas.sentinel`)."""
    options: dict[str, Any] = dict(parse_url(url))
    options.pop("connection_class", None)  # rediss: the sentinel pool's own TLS connection
    tls = tls_ca_file is not None or url.startswith("rediss://")
    if tls_ca_file is not None:
        tls_context(tls_ca_file)
        options |= {"ssl_ca_certs": tls_ca_file, "ssl_cert_reqs": "required"}
    if tls:
        options |= {"ssl": True, "ssl_min_version": ssl.TLSVersion.TLSv1_2}
    if credentials is not None:
        options |= {"username": credentials.user, "password": credentials.password}
    asking: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if sentinel_credentials is not None:
        asking |= {
            "username": sentinel_credentials.user,
            "password": sentinel_credentials.password,
        }
    finder = Sentinel(list(sentinels), sentinel_kwargs=asking)
    client: aioredis.Redis = finder.master_for(
        master,
        **options,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
    )
    return client


class IndexStore:
    """The index's Redis writes. Every method raises `redis.RedisError` when Redis fails."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._apply = client.register_script(APPLY_LUA)
        self._expire = client.register_script(EXPIRE_LUA)

    async def load_meta(self, engine_id: str) -> EngineMeta | None:
        """The stored meta of an engine, or None when it has none (or it is unreadable)."""
        raw = await self.client.hgetall(redis_keys.engine_meta(engine_id))
        try:
            return EngineMeta(
                int(raw["epoch"]),
                int(raw.get("seq", -1)),
                str(raw["bucket"]),
                str(raw["namespace"]),
            )
        except (KeyError, ValueError):
            return None

    async def apply(
        self,
        engine_id: str,
        meta: EngineMeta,
        ops: Sequence[tuple[str, int]] = (),
        clear: bool = False,
        alive_ttl_ms: int = 0,
    ) -> int:
        """Apply `ops` (see `event_ops`) after dropping every entry when `clear`; write meta.

        With `alive_ttl_ms` > 0 the alive key is created if absent, so an engine whose events
        arrive before its first heartbeat is not expired at once. Returns the pages held.
        """
        argv: list[str | int] = [
            engine_id,
            PAGE_PREFIX,
            "1" if clear else "0",
            alive_ttl_ms,
            str(meta.epoch),
            meta.seq,
            meta.bucket,
            meta.namespace,
        ]
        for page_hash, signed_bit in ops:
            argv += [page_hash, signed_bit]
        return int(await self._apply(keys=_engine_keys(engine_id), args=argv))

    async def store(self, store_id: str, page_hashes: Sequence[str], ttl_s: int) -> None:
        """Record `page_hashes` as held by external store `store_id` for `ttl_s` (one round
        trip; a page stored again gets its full TTL back)."""
        if not page_hashes:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for h in page_hashes:
                pipe.set(redis_keys.store_page(store_id, h), "1", ex=ttl_s)
            await pipe.execute()

    async def heartbeat(self, engine_id: str, meta: EngineMeta, ttl_ms: int) -> None:
        """Refresh liveness (alive key = epoch, TTL `ttl_ms`) and the engine's meta."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(redis_keys.engine_alive(engine_id), str(meta.epoch), px=ttl_ms)
            pipe.sadd(redis_keys.ENGINES, engine_id)
            pipe.hset(
                redis_keys.engine_meta(engine_id),
                mapping={
                    "epoch": str(meta.epoch),
                    "bucket": meta.bucket,
                    "namespace": meta.namespace,
                },
            )
            await pipe.execute()

    async def dead_engines(self) -> list[str]:
        """Engines in `hc:engines` whose alive key is gone."""
        engine_ids = sorted(str(e) for e in await self.client.smembers(redis_keys.ENGINES))
        if not engine_ids:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for engine_id in engine_ids:
                pipe.exists(redis_keys.engine_alive(engine_id))
            alive = await pipe.execute()
        return [e for e, n in zip(engine_ids, alive, strict=True) if not n]

    async def expire(self, engine_id: str) -> int | None:
        """Drop all of a dead engine's keys; the number of pages dropped, None if it is alive."""
        dropped = int(
            await self._expire(keys=_engine_keys(engine_id), args=[engine_id, PAGE_PREFIX])
        )
        return None if dropped < 0 else dropped

    async def engine_ids(self) -> list[str]:
        """Every engine id in `hc:engines` (those a resync must clear, known to this index
        or not)."""
        return sorted(str(e) for e in await self.client.smembers(redis_keys.ENGINES))

    async def synced_marker(self) -> str | None:
        """The run id under `INDEX_SYNCED`: the server the index last finished a resync on."""
        value = await self.client.get(INDEX_SYNCED)
        return None if value is None else str(value)

    async def mark_synced(self, run_id: str) -> None:
        """Say that every engine's entries on the server `run_id` came from the engines."""
        await self.client.set(INDEX_SYNCED, run_id)

    async def run_id(self) -> str:
        """The Redis server's run id: it changes when the server restarts (and lost its data)."""
        info = await self.client.info("server")
        return str(info.get("run_id", ""))
