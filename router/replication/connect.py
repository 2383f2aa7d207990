"""A Redis client from a URL: plain, TLS, Sentinel or Cluster, with bounded timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from router.errors import ConfigError

SOCKET_TIMEOUT_S = 2.0
RETRIES = 2


def _options() -> dict[str, Any]:
    return {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SOCKET_TIMEOUT_S,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        "health_check_interval": 10,
    }


@dataclass(slots=True)
class RedisHandle:
    """The client the router uses, and what else must close with it (Sentinel's own
    connections to the sentinels)."""

    client: Redis | RedisCluster
    sentinels: list[Redis] = field(default_factory=list)

    async def aclose(self) -> None:
        await self.client.aclose()
        for sentinel in self.sentinels:
            await sentinel.aclose()


def connect(url: str) -> RedisHandle:
    """``redis+sentinel://h1:26379,h2:26379/service[/db]`` asks Sentinel for the master;
    ``redis+cluster://host:port`` talks to a Cluster (all keys share one hash slot)."""
    if url.startswith("redis+cluster://"):
        return RedisHandle(
            RedisCluster.from_url(
                "redis://" + url.removeprefix("redis+cluster://"),
                socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=SOCKET_TIMEOUT_S,
            )
        )
    if url.startswith("redis+sentinel://"):
        parts = urlsplit(url)
        hosts = []
        for item in parts.netloc.split("@")[-1].split(","):
            host, _, port = item.partition(":")
            hosts.append((host, int(port or 26379)))
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ConfigError("state.url: redis+sentinel:// needs /service_name")
        db = int(path[1]) if len(path) > 1 else 0
        sentinel = Sentinel(hosts, socket_timeout=SOCKET_TIMEOUT_S)  # type: ignore[no-untyped-call,unused-ignore]
        client: Redis = sentinel.master_for(path[0], db=db, **_options())
        return RedisHandle(client, list(sentinel.sentinels))
    return RedisHandle(Redis.from_url(url, **_options()))
