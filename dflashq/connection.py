"""Connecting to the run's Redis, with one clear sentence when it is not there."""

from __future__ import annotations

import redis

from dflashq.exceptions import RedisUnavailable


def connect(url: str, check: bool = True) -> redis.Redis:
    """A Redis client for `url` (redis://, rediss://, unix://; passwords in the URL work)."""
    if not url:
        raise RedisUnavailable("No Redis URL is configured: set redis.url, REDIS_URL, or run through `dflashq` to use the embedded Redis.")
    try:
        conn = redis.Redis.from_url(url, health_check_interval=30, socket_connect_timeout=5)
        if check:
            conn.ping()
    except redis.AuthenticationError:
        raise RedisUnavailable(f"Redis at {redact(url)} refused the password: fix the credentials in redis.url or REDIS_URL.") from None
    except (redis.ConnectionError, redis.TimeoutError, ValueError) as exc:
        raise RedisUnavailable(f"Redis at {redact(url)} cannot be reached ({exc.__class__.__name__}): start it or fix redis.url / REDIS_URL.") from None
    return conn


def redact(url: str) -> str:
    """The URL without its password, for messages and status output."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"
