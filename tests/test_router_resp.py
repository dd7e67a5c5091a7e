"""The router's Redis client (`router.resp`): the wire format as pure functions, then a real
redis-server: pipelined replies in order, a caller that gives up leaves the stream in step,
NOSCRIPT, an outage and a restart, a stopped server's overdue connection replaced."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

from bus_schemas import redis_keys
from router.resp import (
    NoScriptError,
    RedisAddress,
    RedisError,
    RespClient,
    discard,
    encode_command,
    parse_reply,
    parse_url,
)
from services.launch.servers import ServerProcess, start_redis

pytestmark = pytest.mark.timeout(60)


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert encode_command(("PING",)) == b"*1\r\n$4\r\nPING\r\n"
    assert encode_command(("EVALSHA", "ab", b"\x00\r\n")) == (
        b"*3\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$3\r\n\x00\r\n\r\n"
    )


REPLIES: list[tuple[bytes, Any]] = [
    (b"+PONG\r\n", "PONG"),
    (b":42\r\n", 42),
    (b"$5\r\nhe\r\no\r\n", "he\r\no"),
    (b"$-1\r\n", None),
    (b"*0\r\n", []),
    (b"*3\r\n$7\r\nbench-0\r\n:16\r\n*2\r\n:1\r\n$0\r\n\r\n", ["bench-0", 16, [1, ""]]),
]


@pytest.mark.parametrize(("wire", "value"), REPLIES)
def test_replies_parse_whole_and_wait_for_every_missing_byte(wire: bytes, value: Any) -> None:
    assert parse_reply(wire + b":7\r\n", 0) == (value, len(wire))
    for cut in range(len(wire)):
        assert parse_reply(wire[:cut], 0) is None


def test_error_replies_are_values_and_noscript_is_its_own_kind() -> None:
    err, pos = parse_reply(b"-ERR bad\r\n", 0) or (None, 0)
    assert type(err) is RedisError and str(err) == "ERR bad" and pos == 10
    err, _ = parse_reply(b"-NOSCRIPT No matching script\r\n", 0) or (None, 0)
    assert isinstance(err, NoScriptError)
    with pytest.raises(ConnectionError):
        parse_reply(b"?what\r\n", 0)


def test_urls() -> None:
    assert parse_url("redis://127.0.0.1:6390/0") == RedisAddress(port=6390)
    assert parse_url("redis://:pw@host/3") == RedisAddress("host", db=3, password="pw")
    assert parse_url("rediss://u:p%40ss@h:1") == RedisAddress(
        "h", 1, username="u", password="p@ss", tls=True
    )
    assert parse_url("unix:///tmp/r.sock?db=2") == RedisAddress(unix_path="/tmp/r.sock", db=2)
    with pytest.raises(ValueError, match="scheme"):
        parse_url("http://x")


async def test_concurrent_commands_pipeline_and_get_their_own_replies(
    redis_server: ServerProcess,
) -> None:
    client = RespClient(redis_server.url)
    try:
        await client.ping()
        keys = [f"hc:test:resp:{i}" for i in range(50)]
        await asyncio.gather(*(client.execute("SET", k, str(i)) for i, k in enumerate(keys)))
        values = await asyncio.gather(*(client.execute("GET", k) for k in keys))
        assert values == [str(i) for i in range(50)]
        await client.execute("DEL", *keys)
    finally:
        await client.aclose()


async def test_a_caller_that_gives_up_leaves_the_stream_in_step(
    fresh_redis: ServerProcess,
) -> None:
    client = RespClient(fresh_redis.url)
    try:
        await client.execute("SET", "k", "v")
        slow = asyncio.ensure_future(client.execute("EVAL", "redis.call('GET', 'k')", "0"))
        blocked = asyncio.ensure_future(client.execute("BLPOP", "no-such-list", "0.2"))
        await asyncio.sleep(0.05)
        blocked.cancel()  # its reply (nil after 0.2 s) must not go to the next caller
        assert await client.execute("GET", "k") == "v"
        assert await slow is None
        assert blocked.cancelled()
    finally:
        await client.aclose()


async def test_send_writes_at_once_and_a_discarded_reply_leaves_the_stream_in_step(
    fresh_redis: ServerProcess,
) -> None:
    client = RespClient(fresh_redis.url)
    try:
        first = client.send("SET", "n", "1")  # no connection yet: sent once awaited
        assert asyncio.iscoroutine(first)
        assert await first == "OK"
        reply = client.send("INCR", "n")  # on its way now, before anyone awaits it
        assert isinstance(reply, asyncio.Future)
        await asyncio.sleep(0.1)
        assert reply.done() and reply.result() == 2
        discard(client.send("INCR", "n"))  # sent: it runs, its reply goes nowhere
        assert await client.execute("GET", "n") == "3"
        await client.aclose()
        discard(client.send("INCR", "n"))  # not connected: never sent
        assert await client.execute("GET", "n") == "3"
    finally:
        await client.aclose()


async def test_noscript_then_load_then_evalsha(fresh_redis: ServerProcess) -> None:
    client = RespClient(fresh_redis.url)
    try:
        with pytest.raises(NoScriptError):
            await client.evalsha("0" * 40, 0)
        sha = await client.script_load(redis_keys.PREFIX_LOOKUP_LUA)
        assert await client.evalsha(sha, 0, "") == []
        with pytest.raises(RedisError, match="32 hex"):
            await client.evalsha(sha, 0, "abc")
        assert await client.execute("PING") == "PONG"  # the error did not break the stream
    finally:
        await client.aclose()


async def test_down_then_back_on_the_same_port(fresh_redis: ServerProcess) -> None:
    client = RespClient(fresh_redis.url, connect_timeout_s=0.3)
    try:
        await client.execute("SET", "k", "1")
        fresh_redis.stop()
        with pytest.raises(ConnectionError):
            await client.ping()
        with pytest.raises(ConnectionError):  # refused: nothing listens
            await client.ping()
        new = start_redis(fresh_redis.port)
        try:
            assert await client.execute("GET", "k") is None  # a new, empty Redis
        finally:
            new.stop()
    finally:
        await client.aclose()


async def test_a_stopped_server_s_overdue_connection_is_replaced(
    fresh_redis: ServerProcess,
) -> None:
    client = RespClient(fresh_redis.url, reply_timeout_s=0.2)
    try:
        await client.ping()
        fresh_redis.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await client.ping()
            first = client._conn
            late = asyncio.ensure_future(client.ping())  # overdue: a new connection
            await asyncio.sleep(0.05)
            assert client._conn is not first and first is not None and first.closed
        finally:
            fresh_redis.proc.send_signal(signal.SIGCONT)
        await late
        assert await client.execute("PING") == "PONG"
    finally:
        await client.aclose()
