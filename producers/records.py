"""Reading dataset files into records: JSONL (optionally gzipped), JSON, Parquet and `datasets` save_to_disk folders.

A bad line or row becomes a Record with `error` set, never an exception, so one broken record cannot stop a run;
a missing, unrecognised or unreadable input raises InputError.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from dflashq.exceptions import InputError

PARQUET_BATCH_ROWS = 1024  # streaming: only one row batch of a Parquet file is in memory at a time
FORMATS = ".jsonl, .jsonl.gz, .json, .parquet or a `datasets` save_to_disk folder"


@dataclasses.dataclass(frozen=True)
class Record:
    source: str  # "file:line" (JSONL, 1-based) or "file#index" (JSON arrays, Parquet and datasets rows, 0-based)
    data: dict | None
    error: str | None = None


def require_input(path: str) -> None:
    if not os.path.exists(path):
        raise InputError(f"Input {path} does not exist: fix data.paths or the file argument.")


def iter_records(path: str) -> Iterator[Record]:
    """Every record of one input, in file order."""
    require_input(path)
    if os.path.isdir(path):
        return _iter_arrow_files(path, _arrow_files(path))
    if path.endswith(".jsonl"):
        return _iter_jsonl(path, open)
    if path.endswith(".jsonl.gz"):
        return _iter_jsonl(path, gzip.open)
    if path.endswith(".json"):
        return _iter_json(path)
    if path.endswith(".parquet"):
        return _iter_parquet(path)
    raise InputError(f"Dataset file {path} has an unknown format; use {FORMATS}.")


def count_records(path: str) -> int | None:
    """How many records `iter_records(path)` yields, bad ones included, for progress bars; None where only parsing
    the whole file would tell (JSON, gzipped JSONL)."""
    require_input(path)
    try:
        if os.path.isdir(path):  # memory-mapped: reading batch lengths touches no row data
            files = _arrow_files(path)
            return sum(batch.num_rows for file in files for batch in pa.ipc.open_stream(pa.memory_map(file)))
        if path.endswith(".parquet"):
            return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError):
        return None  # iter_records says what is wrong with it
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    return None


def _iter_jsonl(path: str, opener) -> Iterator[Record]:
    with opener(path, "rb") as stream:
        try:
            yield from _parse_lines(path, stream)
        except (EOFError, gzip.BadGzipFile) as exc:
            raise InputError(f"Dataset file {path} is a truncated or corrupt gzip file ({exc}).") from None


def _parse_lines(path: str, stream) -> Iterator[Record]:
    for number, raw in enumerate(stream, start=1):
        source = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield Record(source, None, "invalid UTF-8")
            continue
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Record(source, None, f"malformed JSON: {exc.msg}")
            continue
        yield _record(source, data)


def _iter_json(path: str) -> Iterator[Record]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"Dataset file {path} is not valid JSON ({exc}).") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise InputError(f'Dataset file {path} must hold a JSON list of objects or {{"data": [...]}}.')
    for index, item in enumerate(data):
        yield _record(f"{path}#{index}", item)


def _iter_parquet(path: str) -> Iterator[Record]:
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"Dataset file {path} is not a readable Parquet file ({exc}).") from None
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield Record(f"{path}#{index}", row)
            index += 1


def _iter_arrow_files(path: str, files: list[str]) -> Iterator[Record]:
    index = 0
    for file in files:
        try:
            reader = pa.ipc.open_stream(pa.memory_map(file))
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"Arrow file {file} is not a readable Arrow stream ({exc}).") from None
        for batch in reader:
            for row in batch.to_pylist():
                yield Record(f"{path}#{index}", row)
                index += 1


def _arrow_files(path: str) -> list[str]:
    """The data files of a save_to_disk folder, in dataset order (state.json lists them; else by name)."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(name for name in os.listdir(path) if os.path.isdir(os.path.join(path, name)))
        raise InputError(f"Dataset folder {path} holds several splits ({', '.join(splits)}); give one split's folder.")
    state = os.path.join(path, "state.json")
    if os.path.exists(state):
        with open(state) as f:
            names = [entry["filename"] for entry in json.load(f).get("_data_files", [])]
    else:
        names = sorted(name for name in os.listdir(path) if name.endswith(".arrow"))
    if not names:
        raise InputError(f"Dataset folder {path} has no .arrow files; give a folder written by datasets' save_to_disk.")
    return [os.path.join(path, name) for name in names]


def _record(source: str, data) -> Record:
    if not isinstance(data, dict):
        return Record(source, None, "record is not a JSON object")
    return Record(source, data)


def data_fingerprint(paths: Iterable[str]) -> str:
    """Hex sha256 over the inputs' names, sizes and modification times, in the order given (cheap: reads no data)."""
    digest = hashlib.sha256()
    for path in paths:
        require_input(path)
        path = os.path.normpath(path)
        files = [path]
        if os.path.isdir(path):
            files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
        for file in files:
            stat = os.stat(file)
            name = os.path.basename(path) + file[len(path) :]
            digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
