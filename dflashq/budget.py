"""The store byte budget, held as a hard limit.

Bytes count against `max_store_bytes` from the moment a worker starts a chunk (a reservation of the chunk's
uncompressed size, an upper bound of its blob) until the trainer acknowledges its blob: at announce the
reservation turns into the blob's real size (`store_bytes`), at acknowledgement that is released. So several
workers finishing at once can never push the store over its budget. A chunk larger than the whole budget may
still start when nothing else is held, so that a too-small budget slows the run instead of stalling it.
"""

from __future__ import annotations

import redis

from dflashq.keys import Keys

_RESERVE = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(redis.call('GET', KEYS[2]) or '0')
if used == 0 or used + tonumber(ARGV[2]) <= tonumber(ARGV[3]) then
  redis.call('INCRBY', KEYS[2], ARGV[2])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  return 1
end
return 0
"""

# Used by release() and inside the announce script: a reservation ends exactly once.
RELEASE_LUA = """
local need = redis.call('HGET', KEYS[2], ARGV[1])
if need then
  redis.call('DECRBY', KEYS[1], need)
  redis.call('HDEL', KEYS[2], ARGV[1])
end
"""


def used_bytes(conn: redis.Redis, keys: Keys) -> int:
    """Announced-but-unacknowledged blob bytes plus reservations of chunks being extracted."""
    stored, reserved = conn.mget(keys.store_bytes, keys.reserved_bytes)
    return int(stored or 0) + int(reserved or 0)


def reserve(conn: redis.Redis, keys: Keys, worker: str, chunk: str, need: int, limit: int) -> bool:
    """Reserve `need` bytes for `worker`'s `chunk` if the budget allows; recorded per worker, so the
    reservations of a worker that dies are released by recovery."""
    return bool(conn.eval(_RESERVE, 3, keys.store_bytes, keys.reserved_bytes, keys.reservations(worker), chunk, need, limit))


def release(conn: redis.Redis, keys: Keys, worker: str, chunk: str) -> None:
    conn.eval(RELEASE_LUA, 2, keys.reserved_bytes, keys.reservations(worker), chunk)


def release_all(conn: redis.Redis, keys: Keys, worker: str) -> None:
    """Release every reservation of a (dead) worker."""
    for chunk in conn.hkeys(keys.reservations(worker)):
        release(conn, keys, worker, chunk.decode())
