"""Connecting to the run's Redis: one clear sentence when it is not there, and a lost connection ridden through.

Every command of a run talks to Redis all the time, and over a multi-day run Redis restarts (an upgrade, a reboot,
an OOM kill). So a connection or timeout error is an outage, not an error: the client retries every command with
exponential backoff for up to `redis.outage_seconds`, says once that Redis is unreachable and once that it is back,
and only past that limit does the command end with the sentence of `RedisUnavailable`. Every write of the run is
safe to repeat (Lua scripts guarded by sets, idempotent admission), so a command retried after a reply was lost
does no harm. `heal`, when given, is called while retrying: it restarts the run's embedded Redis.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from dflashq import defaults
from dflashq.exceptions import RedisUnavailable

BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 5.0
HEAL_EVERY_S = 1.0


class OutageRetry(Retry):
    """redis-py's Retry, bounded by time rather than attempts, saying when an outage starts and ends."""

    def __init__(self, url: str, outage_seconds: float, heal: Callable[[], object] | None = None):
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries=-1,
                         supported_errors=(redis.ConnectionError, redis.TimeoutError, TimeoutError))
        self.url, self.outage_seconds, self.heal = url, outage_seconds, heal
        self.down_since: float | None = None  # wall time of the first failure of the current outage
        self._healed_at = 0.0

    def __deepcopy__(self, memo):
        return self  # redis-py copies the retry into every pooled connection: one outage, one state, one message

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                now = time.time()
                if self.down_since is None:
                    self.down_since = now
                    _say(f"Redis at {redact(self.url)} is unreachable ({error.__class__.__name__}); retrying for up "
                         f"to {self.outage_seconds:.0f} s (redis.outage_seconds)")
                if now - self.down_since >= self.outage_seconds:
                    raise
                if self.heal is not None and now - self._healed_at >= HEAL_EVERY_S:
                    self._healed_at = now
                    try:
                        self.heal()
                    except Exception:  # noqa: BLE001 - healing is best effort; the retry goes on either way
                        pass
                time.sleep(self._backoff.compute(failures))
            else:
                if self.down_since is not None:
                    _say(f"Redis at {redact(self.url)} is back after {time.time() - self.down_since:.0f} s")
                    self.down_since = None
                return result


def _say(message: str) -> None:
    print(f"dflashq: {message}", file=sys.stderr, flush=True)


def connect(url: str, check: bool = True, outage_seconds: float = defaults.REDIS_OUTAGE_SECONDS,
            heal: Callable[[], object] | None = None) -> redis.Redis:
    """A Redis client for `url` (redis://, rediss://, unix://; passwords in the URL work) that rides through
    outages of up to `outage_seconds`."""
    if not url:
        raise RedisUnavailable("No Redis URL is configured: set redis.url, REDIS_URL, or run through `dflashq` to use the embedded Redis.")
    try:
        conn = redis.Redis.from_url(url, health_check_interval=30, socket_connect_timeout=5,
                                    retry=OutageRetry(url, outage_seconds, heal),
                                    retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        if check:
            conn.ping()
    except redis.AuthenticationError:
        raise RedisUnavailable(f"Redis at {redact(url)} refused the password: fix the credentials in redis.url or REDIS_URL.") from None
    except (redis.ConnectionError, redis.TimeoutError, ValueError) as exc:
        raise RedisUnavailable(f"Redis at {redact(url)} cannot be reached ({exc.__class__.__name__}): start it or fix redis.url / REDIS_URL.") from None
    return conn


def outage_since(conn: redis.Redis) -> float | None:
    """Wall time since which `conn`'s Redis has been unreachable (None: reachable as far as it knows)."""
    retry = conn.get_connection_kwargs().get("retry")
    return retry.down_since if isinstance(retry, OutageRetry) else None


def redact(url: str) -> str:
    """The URL without its password, for messages and status output."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"
