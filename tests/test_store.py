"""The results store through fsspec (the code path of s3:// and other remote stores), with fsspec's in-memory
filesystem standing in for a bucket, next to the local-directory path."""

from __future__ import annotations

import pytest

from dflashq.store import Store


@pytest.mark.parametrize("root", ["memory://bucket/runs", "LOCAL"])
def test_store_round_trip(tmp_path, root):
    store = Store(str(tmp_path) if root == "LOCAL" else root, "r")
    path = store.blob_path("r-e0-x-000000000-000000001", 0)
    assert not store.exists(path)
    assert store.write_atomic(path, [b"abc", memoryview(b"defg")]) == 7
    assert store.exists(path) and store.size(path) == 7 and store.read(path) == b"abcdefg"
    assert [p.rsplit("/", 1)[-1] for p in store.listdir("blobs", "e0")] == ["r-e0-x-000000000-000000001.dfq"]
    store.delete(path)
    assert not store.exists(path)
    assert store.remote == (root != "LOCAL")
