"""Results store: where blobs, the run manifest and checkpoints live.

A local (or shared-filesystem) directory by default; an fsspec URL (s3://bucket/prefix, ...) when workers and
trainer sit on different machines. Writes are atomic: a temporary name in the same directory, fsync, rename, so
a reader never sees half a blob.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


class Store:
    def __init__(self, root: str, run: str):
        self.root = root.rstrip("/")
        self.run = run
        self.remote = "://" in root and not root.startswith("file://")
        if self.remote:
            import fsspec  # only needed for remote stores

            self.fs, _ = fsspec.core.url_to_fs(self.root)
        else:
            self.root = self.root.removeprefix("file://")

    @property
    def run_dir(self) -> str:
        return f"{self.root}/{self.run}"

    def path(self, *parts: str) -> str:
        return "/".join([self.run_dir, *parts])

    def blob_path(self, chunk_id: str, epoch: int) -> str:
        return self.path("blobs", f"e{epoch}", f"{chunk_id}.dfq")

    def exists(self, path: str) -> bool:
        return self.fs.exists(path) if self.remote else os.path.exists(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path)) if self.remote else os.path.getsize(path)

    def read(self, path: str) -> bytes:
        if self.remote:
            return self.fs.cat_file(path)
        with open(path, "rb") as f:
            return f.read()

    def write_atomic(self, path: str, data: bytes | memoryview | list) -> int:
        """Write `data` (bytes or a list of buffers) so that `path` appears whole or not at all."""
        parts = data if isinstance(data, list) else [data]
        if self.remote:
            # Object stores publish a PUT atomically; no rename needed.
            with self.fs.open(path, "wb") as f:
                for part in parts:
                    f.write(part)
            return sum(len(memoryview(p).cast("B")) for p in parts)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        written = 0
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    written += f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a crash
        finally:
            os.close(dir_fd)
        return written

    def delete(self, path: str) -> None:
        if self.remote:
            if self.fs.exists(path):
                self.fs.rm(path)
        else:
            Path(path).unlink(missing_ok=True)

    def listdir(self, *parts: str) -> list[str]:
        where = self.path(*parts)
        if self.remote:
            return sorted(self.fs.ls(where, detail=False)) if self.fs.exists(where) else []
        return sorted(os.path.join(where, n) for n in os.listdir(where)) if os.path.isdir(where) else []


@contextlib.contextmanager
def new_folder(out_dir: Path) -> Iterator[Path]:
    """A temporary folder beside the local `out_dir` to write into: on success its files are fsynced and it is
    renamed to `out_dir` (the rename made durable too), on any failure removed; never a half-written folder."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        yield tmp
        for path in tmp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    directory = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)

