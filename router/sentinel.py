"""Where the Redis primary is, asked of Sentinel (`SentinelResolver`).

The router's `RespClient` opens a connection only when it has none (or lost it), and then asks
`resolve()` where to connect: with sentinels, each is asked in turn for the address of the
monitored primary (`SENTINEL get-master-addr-by-name`), so a failover is followed at the
next connection. Each sentinel gets one small `RespClient` of its own, authenticated with the
sentinels' credentials where they require some.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from bus_schemas.connection import Credentials
from bus_schemas.sentinel import Address
from router.resp import RedisError, RespClient


class SentinelResolver:
    """`await resolver()`: the (host, port) the sentinels name as the primary `master`.
    Raises ConnectionError when none of them answers with one. `aclose()` when done."""

    def __init__(
        self,
        sentinels: Sequence[Address],
        master: str,
        credentials: Credentials | None = None,
        timeout_s: float = 0.2,
    ) -> None:
        if not sentinels:
            raise ValueError("no sentinels")
        self.master = master
        self.timeout_s = timeout_s  # per sentinel asked
        self._clients = [
            RespClient(
                f"redis://{host}:{port}",
                connect_timeout_s=timeout_s,
                reply_timeout_s=timeout_s,
                credentials=credentials,
            )
            for host, port in sentinels
        ]
        self._first = 0  # the sentinel that answered last is asked first

    async def __call__(self) -> tuple[str, int]:
        errors = []
        n = len(self._clients)
        for k in range(n):
            i = (self._first + k) % n
            client = self._clients[i]
            try:
                async with asyncio.timeout(self.timeout_s):
                    reply = await client.execute("SENTINEL", "get-master-addr-by-name", self.master)
            except (OSError, RedisError, TimeoutError) as e:
                await client.aclose()
                self._first = (i + 1) % n
                errors.append(f"{client.address.host}:{client.address.port}: {e!r}")
                continue
            if isinstance(reply, list) and len(reply) == 2:
                self._first = i
                return str(reply[0]), int(reply[1])
            errors.append(f"{client.address.host}:{client.address.port}: no primary {reply!r}")
        raise ConnectionError(f"no sentinel names primary {self.master!r}: {'; '.join(errors)}")

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()
