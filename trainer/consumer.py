"""The trainer's side of the results stream: a consumer group that re-reads its own pending entries first, claims
those of dead consumers, then reads new ones; and an acknowledgement that frees the backlog.

Each trainer rank is a consumer of its own stable name (trainer.ranks). A rank claims only entries of consumers
outside its world: ranks of an earlier, larger world and the single trainer of old (`<host>.trainer`), after they
lay idle for `train.claim_idle_seconds`. A live rank's pending entries are never claimed by another (XAUTOCLAIM
would take them: they are trained, and idle while they wait for the checkpoint that lets them be acknowledged),
and the group restarts together, so every rank re-reads its own on restart.

Entries are acknowledged only after a checkpoint that contains their effect (the daemon's job); acknowledging
removes the chunk from the backlog (`inflight`) and its bytes from the store budget in one Lua script, so the
producer and the workers see the space at once. The stream is never trimmed by length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import redis

from dflashq.keys import TRAINER_GROUP, Keys

CLAIM_PAGE = 100  # pending entries looked at per round trip (live ranks hold up to the backlog limit of them)

_ACK = """
for i, id in ipairs(ARGV) do
  if i % 2 == 1 then
    local chunk = ARGV[i + 1]
    redis.call('XACK', KEYS[1], KEYS[2], id)
    redis.call('SREM', KEYS[3], chunk)
    local bytes = redis.call('HGET', KEYS[4], chunk)
    if bytes then
      redis.call('DECRBY', KEYS[5], bytes)
      redis.call('HDEL', KEYS[4], chunk)
    end
  end
end
return 1
"""


@dataclasses.dataclass(frozen=True)
class Entry:
    id: str
    chunk: str
    path: str
    epoch: int
    tokens: int


def _entries(raw) -> list[Entry]:
    out = []
    for entry_id, fields in raw:
        if not fields:  # an entry deleted from the stream while pending
            continue
        f = {k.decode(): v.decode() for k, v in fields.items()}
        out.append(Entry(entry_id.decode(), f["chunk"], f["path"], int(f["epoch"]), int(f["tokens"])))
    return out


class ResultsConsumer:
    def __init__(self, conn: redis.Redis, keys: Keys, name: str, claim_idle_seconds: float, live: Collection[str] = ()):
        """`live`: the consumer names of every rank of this trainer's world (this one among them)."""
        self.conn = conn
        self.keys = keys
        self.name = name
        self.live = {name, *live}
        self.claim_idle_ms = int(claim_idle_seconds * 1000)
        self._own_pending_done = False
        self._pending_cursor = "0"  # own pending entries are read once each, from the oldest on
        self._ack = conn.register_script(_ACK)
        try:
            conn.xgroup_create(keys.results, TRAINER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int) -> list[Entry]:
        """Own pending entries (a restart), then entries of dead consumers, then new ones."""
        if not self._own_pending_done:
            raw = self.conn.xreadgroup(TRAINER_GROUP, self.name, {self.keys.results: self._pending_cursor}, count=count)
            if raw and raw[0][1]:
                self._pending_cursor = raw[0][1][-1][0].decode()
                return _entries(raw[0][1])
            self._own_pending_done = True
        entries = self._claim(count)
        if entries:
            return entries
        raw = self.conn.xreadgroup(TRAINER_GROUP, self.name, {self.keys.results: ">"}, count=count, block=block_ms)
        return _entries(raw[0][1]) if raw else []

    def _claim(self, count: int) -> list[Entry]:
        """Up to `count` entries that dead consumers left pending, idle for claim_idle_seconds at least. XCLAIM
        checks the idle time again, so of ranks racing for one entry only the first gets it."""
        start = "-"
        while True:
            page = self.conn.xpending_range(self.keys.results, TRAINER_GROUP, start, "+", CLAIM_PAGE,
                                            idle=self.claim_idle_ms)
            dead = [p["message_id"] for p in page if p["consumer"].decode() not in self.live][:count]
            if dead:
                return _entries(self.conn.xclaim(self.keys.results, TRAINER_GROUP, self.name, self.claim_idle_ms, dead))
            if len(page) < CLAIM_PAGE:
                return []
            start = b"(" + page[-1]["message_id"]  # exclusive: the live ranks' entries read so far

    def ack(self, entries: list[Entry]) -> None:
        if not entries:
            return
        args = [x for e in entries for x in (e.id, e.chunk)]
        k = self.keys
        self._ack(keys=[k.results, TRAINER_GROUP, k.inflight, k.blob_bytes, k.store_bytes], args=args)
