"""The extraction job: one chunk -> the target's tapped hidden states -> one blob in the store -> one stream entry.

The GPU never waits on the disk: the states are byte-shuffled on the GPU, copied into pinned host memory, and
compressed, written (temporary name, fsync, rename) and announced by a writer thread while the job returns and
the next chunk's forward runs. A chunk whose job returned but whose blob is not yet announced is recorded as
`unannounced` for this worker, so recovery can re-queue it if the worker dies in between.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import threading
import time

import torch
from rq.job import Job
from rq.serializers import JSONSerializer

from dflashq.blob import encode_blob, quantize_fp8, shuffle_bytes, stored_bytes_per_token
from dflashq.budget import RELEASE_LUA, release, reserve
from dflashq.chunk import Chunk
from dflashq.exceptions import JobRefused
from dflashq.run import Run
from dflashq.capture import HiddenStateCapture
from workers.capture import extract_samples, extraction_batches, warm_up
from workers.fused_kernels import fused_kernels
from workers.recovery import requeue_front, unannounced_key
from dflashq.target import load_target

# Announce exactly once: only the first writer of a chunk id adds the stream entry and counts its bytes; the
# chunk's budget reservation turns into its real size either way.
_ANNOUNCE = RELEASE_LUA + """
redis.call('SREM', KEYS[6], ARGV[1])
if redis.call('SADD', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[4], '*', 'chunk', ARGV[1], 'path', ARGV[2], 'tokens', ARGV[3], 'samples', ARGV[4],
           'bytes', ARGV[5], 'epoch', ARGV[6], 'worker', ARGV[7])
redis.call('HSET', KEYS[5], ARGV[1], ARGV[5])
redis.call('INCRBY', KEYS[7], ARGV[5])
return 1
"""

log = logging.getLogger(__name__)

_active: "Extractor | None" = None


def extract_chunk(payload: dict) -> dict:
    """The one registered job function (dflashq.keys.EXTRACT_FUNCTION); runs inside an ExtractionWorker."""
    if _active is None:
        raise JobRefused("extract_chunk runs only inside `dflashq worker`, which holds the loaded target.")
    return _active.run(Chunk.from_json(payload))


class Extractor:
    """The loaded target plus its capture hooks and writer threads; one per worker process."""

    def __init__(self, run: Run, worker_name: str, device: str, model: torch.nn.Module | None = None):
        """`model`: an already loaded target (benchmarks, notebooks); by default it is loaded from model.path."""
        global _active
        settings = run.settings
        self.run_ctx = run
        self.worker_name = worker_name
        self.device = torch.device(device)
        self.model = model if model is not None else load_target(
            settings.model.path, self.device, settings.model.dtype, settings.model.trust_remote_code)
        self._kernels = contextlib.ExitStack()
        if settings.workers.fused_kernels:
            self._kernels.enter_context(fused_kernels(self.model))
        self.batch_tokens = settings.workers.batch_tokens
        if self.device.type == "cuda":
            started = time.perf_counter()
            shapes = warm_up(self.model, self.batch_tokens)
            log.info("%s: %d batch shapes warmed up in %.1f s", worker_name, shapes, time.perf_counter() - started)
        self.capture = HiddenStateCapture(self.model, run.layer_ids)
        self.max_splits = settings.workers.max_splits
        self.level = settings.workers.compress_level
        self.codec = settings.store.codec
        self.threads = max(1, settings.workers.writer_threads)
        writers = max(1, settings.workers.writers)
        # Bounded: `writers` blobs being written and one waiting for a writer, each in its own host buffer (slot);
        # a chunk copies into the slot whose last write has finished.
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=writers, thread_name_prefix="blob-writer")
        self._pinned: list[torch.Tensor | None] = [None] * (writers + 1)
        self._writes: list[concurrent.futures.Future | None] = [None] * (writers + 1)  # each slot's last write
        self._slot = 0
        self._announce = run.conn.register_script(_ANNOUNCE)
        self._lock = threading.Lock()
        self.tokens_done = 0
        self.chunks_done = 0
        self.first_start: float | None = None
        self.busy_seconds = 0.0  # in jobs, less waiting for the store budget: what `up` balances GPUs by
        # where a chunk's time goes, summed over chunks and published per chunk: the job waiting for the writer
        # (a writer slower than the forward), and in the writer: waiting for the device, encoding, writing (fsync
        # included), announcing
        self.seconds = dict.fromkeys(("writer_wait", "device", "encode", "write", "announce"), 0.0)
        _active = self

    def chunk_bytes(self, tokens: int) -> int:
        """Upper bound of a chunk's blob: its hidden states uncompressed, as the codec stores them."""
        hidden = self.model.config.get_text_config().hidden_size
        return tokens * stored_bytes_per_token(self.codec, len(self.run_ctx.layer_ids), hidden, self.model.dtype)

    # --- forward ------------------------------------------------------------------------------------------
    def _forward(self, chunk: Chunk) -> list[torch.Tensor]:
        """Per-sample hidden states; a chunk that runs out of GPU memory is split into smaller batches."""
        lengths = [len(s) for s in chunk.samples]
        budget = self.batch_tokens
        for attempt in range(self.max_splits + 1):
            try:
                return extract_samples(self.model, self.capture, chunk.samples, budget)
            except torch.OutOfMemoryError:
                # halve the largest padded batch actually tried, not the nominal budget
                largest = max(len(b) * lengths[b[0]] for b in extraction_batches(lengths, budget))
                if attempt == self.max_splits or largest <= max(lengths):
                    raise
                budget = largest // 2
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        raise AssertionError("unreachable")

    def _to_host(self, planes: torch.Tensor) -> torch.Tensor:
        """Copy to the pinned buffer of slot `self._slot` (on CPU the planes already are host memory). The caller
        has waited for the write that last used this buffer."""
        if self.device.type != "cuda":
            return planes
        buf = self._pinned[self._slot]
        if buf is None or buf.numel() < planes.numel():
            buf = self._pinned[self._slot] = torch.empty(planes.numel(), dtype=torch.uint8, pin_memory=True)
        host = buf[: planes.numel()].view(planes.shape)
        host.copy_(planes, non_blocking=True)
        return host

    def _small_to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A small tensor (fp8 scales, errors) to fresh pinned memory without waiting for the device."""
        if self.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def _reserve(self, chunk: Chunk) -> None:
        """Hold the chunk's uncompressed size against the store budget before computing it (dflashq.budget);
        waits (heartbeating: the job is started) while the trainer has not freed enough."""
        run = self.run_ctx
        need = self.chunk_bytes(chunk.tokens)
        while not reserve(run.conn, run.keys, self.worker_name, chunk.id, need, run.settings.backpressure.max_store_bytes):
            time.sleep(run.settings.backpressure.poll_seconds)

    def run(self, chunk: Chunk) -> dict:
        if self.first_start is None:
            self.first_start = time.perf_counter()
        self._reserve(chunk)
        busy_from = time.perf_counter()
        try:
            states = self._forward(chunk)  # per sample [T_i, K, H] on the device
        except BaseException:
            release(self.run_ctx.conn, self.run_ctx.keys, self.worker_name, chunk.id)
            raise
        hidden = torch.cat(states) if len(states) > 1 else states[0]  # [N, K, H]
        fp8 = None
        if self.codec == "fp8":  # quantized on the device: half the bytes cross to the host
            values, scales, error = quantize_fp8(hidden)  # [N, K, H] e4m3, [N, K] fp32, [K]
            planes = shuffle_bytes(values)  # [1, N, K, H] uint8
        else:
            planes = shuffle_bytes(hidden)  # [itemsize, N, K, H] uint8, shuffled on the device
        waited_from = time.perf_counter()
        self._slot = (self._slot + 1) % len(self._writes)
        self._wait_write(self._slot)
        with self._lock:
            self.seconds["writer_wait"] += time.perf_counter() - waited_from
        host = self._to_host(planes)
        if self.codec == "fp8":
            fp8 = (self._small_to_host(scales), self._small_to_host(error))
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:
            done.record()
        conn, keys = self.run_ctx.conn, self.run_ctx.keys
        conn.sadd(unannounced_key(keys, self.worker_name), chunk.id)
        self._writes[self._slot] = self.pool.submit(self._write, chunk, host, hidden.dtype, done, fp8)
        for slot, future in enumerate(self._writes):
            if slot != self._slot and future is not None and future.done():
                self._wait_write(slot)  # surface a failed write of an earlier chunk
        # the GPU work a job queues is done by the time a later job has waited for its writes: over many jobs this
        # is the time the device was busy
        self.busy_seconds += time.perf_counter() - busy_from
        return {"chunk": chunk.id, "tokens": chunk.tokens, "samples": len(chunk.samples)}

    # --- writer thread ------------------------------------------------------------------------------------
    def _write(self, chunk: Chunk, host: torch.Tensor, dtype: torch.dtype, done, fp8) -> None:
        try:
            self._write_and_announce(chunk, host, dtype, done, fp8)
        except Exception:
            # The job already returned: give the chunk back to the queue rather than lose it.
            log.exception("writing the blob of %s failed; re-queueing it", chunk.id)
            conn = self.run_ctx.conn
            release(conn, self.run_ctx.keys, self.worker_name, chunk.id)
            requeue_front(conn, Job.fetch(chunk.id, connection=conn, serializer=JSONSerializer))
            conn.srem(unannounced_key(self.run_ctx.keys, self.worker_name), chunk.id)
            raise

    def _write_and_announce(self, chunk: Chunk, host: torch.Tensor, dtype: torch.dtype, done, fp8) -> None:
        """fp8: (scales [N, K], relative error [K]) of the quantized states in `host`."""
        started = time.perf_counter()
        if done is not None:
            done.synchronize()
        synced = time.perf_counter()
        run, keys = self.run_ctx, self.run_ctx.keys
        lengths = [len(s) for s in chunk.samples]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        meta = {"run": run.settings.run, "chunk_id": chunk.id, "epoch": chunk.epoch, "layer_ids": run.layer_ids}
        ids = torch.cat([torch.from_numpy(s.input_ids) for s in chunk.samples])
        mask = torch.cat([torch.from_numpy(s.loss_mask) for s in chunk.samples])
        scales, error = fp8 if fp8 is not None else (None, None)
        buffers = encode_blob(host, ids, mask, offsets, meta, self.level, self.threads,
                              sample_index=[s.index for s in chunk.samples], dtype=dtype, codec=self.codec,
                              scales=scales, relative_error=error.tolist() if error is not None else None)
        encoded = time.perf_counter()
        path = run.store.blob_path(chunk.id, chunk.epoch)
        size = run.store.write_atomic(path, buffers)
        written = time.perf_counter()
        self._announce(
            keys=[keys.reserved_bytes, keys.reservations(self.worker_name), keys.finished, keys.results,
                  keys.blob_bytes, unannounced_key(keys, self.worker_name), keys.store_bytes],
            args=[chunk.id, path, chunk.tokens, len(chunk.samples), size, chunk.epoch, self.worker_name],
        )
        announced = time.perf_counter()
        with self._lock:
            self.tokens_done += chunk.tokens
            self.chunks_done += 1
            for part, seconds in (("device", synced - started), ("encode", encoded - synced),
                                  ("write", written - encoded), ("announce", announced - written)):
                self.seconds[part] += seconds
            elapsed = max(time.perf_counter() - self.first_start, 1e-9)
            run.conn.hset(keys.workers, self.worker_name, json.dumps({
                "tokens_done": self.tokens_done, "tokens_per_second": self.tokens_done / elapsed,
                "busy_tokens_per_second": self.tokens_done / self.busy_seconds if self.busy_seconds else None,
                "seconds_per_chunk": {k: round(v / self.chunks_done, 4) for k, v in self.seconds.items()},
                "updated": time.time(),
            }))

    def flush(self) -> None:
        """Wait until every blob handed to the writers is written and announced (warm shutdown)."""
        for slot in range(len(self._writes)):
            self._wait_write(slot)

    def _wait_write(self, slot: int) -> None:
        """Wait for the last write from `slot`'s buffer, raising its failure once."""
        future, self._writes[slot] = self._writes[slot], None
        if future is not None:
            future.result()

    def close(self) -> None:
        global _active
        self.flush()
        self.pool.shutdown(wait=True)
        self.capture.close()
        self._kernels.close()
        if _active is self:
            _active = None
