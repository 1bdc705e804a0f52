"""Backpressure and idempotent admission against a real Redis."""

from __future__ import annotations

import threading
import time

import numpy as np
import redis

from dflashq.chunk import Chunk, Sample, chunk_id
from dflashq.keys import Keys
from dflashq.store import Store
from ops.redis_server import EmbeddedRedis
from producers.admission import Admission, Outcome, run_queue


def make_chunk(i: int, epoch: int = 0) -> Chunk:
    ids = np.arange(10, dtype=np.int32)
    return Chunk(chunk_id("t", "f" * 16, epoch, i, i), epoch, [Sample(ids, np.ones(10, np.uint8), i)])


def admission(conn, tmp_path, max_backlog=4, max_store_bytes=10**9) -> Admission:
    return Admission(conn, "t", Store(str(tmp_path), "t"), max_backlog, max_store_bytes, job_timeout=60)


def test_admits_until_backlog_limit_then_waits(conn, tmp_path):
    adm = admission(conn, tmp_path, max_backlog=3)
    outcomes = [adm.try_admit(make_chunk(i)) for i in range(5)]
    assert outcomes == [Outcome.ADMITTED] * 3 + [Outcome.WAIT] * 2
    assert run_queue(conn, "t").count == 3
    # the trainer acknowledging one chunk frees one slot
    conn.srem(Keys("t").inflight, make_chunk(0).id)
    assert adm.try_admit(make_chunk(3)) == Outcome.ADMITTED
    assert adm.try_admit(make_chunk(4)) == Outcome.WAIT


def test_same_chunk_twice_adds_nothing(conn, tmp_path):
    adm = admission(conn, tmp_path)
    assert adm.try_admit(make_chunk(1)) == Outcome.ADMITTED
    assert adm.try_admit(make_chunk(1)) == Outcome.DUPLICATE
    assert run_queue(conn, "t").count == 1
    # a later epoch is a different chunk (re-extraction under retention=delete)
    assert adm.try_admit(make_chunk(1, epoch=1)) == Outcome.ADMITTED


def test_chunk_with_existing_blob_is_skipped(conn, tmp_path):
    adm = admission(conn, tmp_path)
    chunk = make_chunk(7)
    adm.store.write_atomic(adm.store.blob_path(chunk.id, 0), b"blob")
    assert adm.try_admit(chunk) == Outcome.EXISTS
    assert run_queue(conn, "t").count == 0


def test_store_byte_budget_blocks_admission(conn, tmp_path):
    adm = admission(conn, tmp_path, max_backlog=100, max_store_bytes=1000)
    conn.set(Keys("t").store_bytes, 1000)
    assert adm.try_admit(make_chunk(1)) == Outcome.WAIT
    conn.set(Keys("t").store_bytes, 999)
    assert adm.try_admit(make_chunk(1)) == Outcome.ADMITTED


def test_two_producers_never_exceed_the_limit(redis_url, tmp_path):
    """Two producers race for the last slots while a consumer frees slots; a watcher samples the backlog."""
    limit, n = 5, 120
    keys = Keys("t")
    seen_max = [0]
    stop = threading.Event()

    def watcher():
        c = redis.Redis.from_url(redis_url)
        while not stop.is_set():
            seen_max[0] = max(seen_max[0], c.scard(keys.inflight))

    def producer(offset):
        adm = admission(redis.Redis.from_url(redis_url), tmp_path, max_backlog=limit)
        for i in range(offset, n, 2):
            while adm.try_admit(make_chunk(i)) == Outcome.WAIT:
                time.sleep(0.001)

    def consumer():
        c = redis.Redis.from_url(redis_url)
        done = 0
        while done < n:
            member = c.spop(keys.inflight)
            if member is None:
                time.sleep(0.001)
            else:
                done += 1

    threads = [threading.Thread(target=f, args=a) for f, a in [(watcher, ()), (producer, (0,)), (producer, (1,)), (consumer, ())]]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(timeout=60)
    stop.set()
    threads[0].join()
    conn = redis.Redis.from_url(redis_url)
    assert conn.scard(keys.admitted(0)) == n
    assert run_queue(conn, "t").count == n
    assert 0 < seen_max[0] <= limit


def test_embedded_redis_survives_sigkill(tmp_path):
    server = EmbeddedRedis(str(tmp_path))
    url = server.ensure()
    try:
        adm = Admission(redis.Redis.from_url(url), "t", Store(str(tmp_path), "t"), 100, 10**9, 60)
        for i in range(10):
            assert adm.try_admit(make_chunk(i)) == Outcome.ADMITTED
        server.kill()
        assert server.ensure() == url  # same port again, so connected clients reconnect
        conn = redis.Redis.from_url(url)
        assert conn.scard(Keys("t").inflight) == 10
        assert run_queue(conn, "t").count == 10
        assert adm.try_admit(make_chunk(3)) == Outcome.DUPLICATE
    finally:
        server.stop()
