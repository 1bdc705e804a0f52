"""Reading every supported input format into records, with bad lines as error records, not exceptions."""

from __future__ import annotations

import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflashq.exceptions import InputError
from producers.records import Record, count_records, data_fingerprint, iter_records

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(5)
]


def test_jsonl_with_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps(ROWS[0]).encode(),
        b'{"messages": [',  # malformed JSON
        b"",  # blank lines are skipped
        '{"prompt": "caf\xe9"}'.encode("latin-1"),  # invalid UTF-8
        b"[1, 2]",  # valid JSON, not an object
        json.dumps(ROWS[1], ensure_ascii=False).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    records = list(iter_records(str(path)))
    assert [r.source for r in records] == [f"{path}:{n}" for n in (1, 2, 4, 5, 6)]
    assert records[0] == Record(f"{path}:1", ROWS[0])
    assert records[1].data is None and records[1].error.startswith("malformed JSON")
    assert records[2] == Record(f"{path}:4", None, "invalid UTF-8")
    assert records[3] == Record(f"{path}:5", None, "record is not a JSON object")
    assert records[4].data == ROWS[1] and records[4].error is None
    assert count_records(str(path)) == len(records)


def test_gzipped_jsonl(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in ROWS)
    assert [r.data for r in iter_records(str(path))] == ROWS
    assert count_records(str(path)) is None  # would need decompressing everything

    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(InputError, match="cut.jsonl.gz"):
        list(iter_records(str(truncated)))


@pytest.mark.parametrize("wrap", [lambda rows: rows, lambda rows: {"data": rows}], ids=["list", "data-key"])
def test_json(tmp_path, wrap):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(wrap(ROWS + ["not an object"])))
    records = list(iter_records(str(path)))
    assert [r.data for r in records[:-1]] == ROWS
    assert [r.source for r in records] == [f"{path}#{i}" for i in range(6)]
    assert records[-1].error == "record is not a JSON object"


@pytest.mark.parametrize("content", ["[{", '{"rows": []}', "3"], ids=["malformed", "no-data-key", "scalar"])
def test_unusable_json_file(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InputError, match="bad.json"):
        list(iter_records(str(path)))


def test_parquet_streams_row_batches(tmp_path):
    rows = ROWS * 500  # several row groups and batches
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=700)
    records = list(iter_records(str(path)))
    assert [r.data for r in records] == rows
    assert records[-1].source == f"{path}#{len(rows) - 1}"
    assert count_records(str(path)) == len(rows)


def write_arrow_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)


def test_datasets_save_to_disk_folder(tmp_path):
    folder = tmp_path / "train"
    folder.mkdir()
    # state.json names the files in dataset order, which here is not name order
    write_arrow_stream(folder / "data-00001-of-00002.arrow", ROWS[:3])
    write_arrow_stream(folder / "data-00000-of-00002.arrow", ROWS[3:])
    (folder / "dataset_info.json").write_text("{}")
    files = [{"filename": "data-00001-of-00002.arrow"}, {"filename": "data-00000-of-00002.arrow"}]
    (folder / "state.json").write_text(json.dumps({"_data_files": files}))
    records = list(iter_records(str(folder)))
    assert [r.data for r in records] == ROWS
    assert [r.source for r in records] == [f"{folder}#{i}" for i in range(5)]
    assert count_records(str(folder)) == 5

    os.remove(folder / "state.json")  # without it, the .arrow files are read in name order
    assert [r.data for r in iter_records(str(folder))] == ROWS[3:] + ROWS[:3]


def test_unusable_inputs(tmp_path):
    for read in (iter_records, count_records, lambda path: data_fingerprint([path])):
        with pytest.raises(InputError, match="missing.jsonl does not exist: fix data.paths"):
            read(str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="unknown format"):
        iter_records(str(tmp_path / "data.csv"))
    with pytest.raises(InputError, match="no .arrow files"):
        iter_records(str(tmp_path))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "train").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(InputError, match=r"several splits \(train\)"):
        iter_records(str(tmp_path / "dd"))


def test_data_fingerprint(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("{}\n")
    b.write_text("{}\n")
    folder = tmp_path / "arrow"
    folder.mkdir()
    write_arrow_stream(folder / "data-00000-of-00001.arrow", ROWS)
    paths = [str(a), str(b), str(folder)]
    first = data_fingerprint(paths)
    assert len(first) == 64 and first == data_fingerprint(paths)
    assert first != data_fingerprint(paths[::-1])  # sample order is part of the data
    b.write_text("{}\n{}\n")
    assert data_fingerprint(paths) != first
    with pytest.raises(InputError, match="gone.jsonl"):
        data_fingerprint([str(tmp_path / "gone.jsonl")])


def test_parquet_rows_mixing_response_and_completion_columns(tmp_path):
    """A table with both columns holds None in the one a row does not use: either column is the answer."""
    from producers.conversation import normalize

    rows = [{"prompt": "a?", "response": "yes", "completion": None}, {"prompt": "b?", "response": None, "completion": "no"}]
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    answers = [normalize(r.data).messages[-1]["content"] for r in iter_records(str(path))]
    assert answers == ["yes", "no"]

