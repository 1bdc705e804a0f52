"""Chunk packing: deterministic, every sample exactly once, within budget, and length-sorted windows cut padding."""

from __future__ import annotations

import numpy as np

from dflashq.chunk import Chunk, Sample, chunk_id, micro_batches, pack, padding_fraction, sample_range


def samples(n=600, seed=0):
    rng = np.random.default_rng(seed)
    return [Sample(np.zeros(int(n_), np.int32), np.ones(int(n_), np.uint8), i) for i, n_ in enumerate(rng.integers(100, 4096, n))]


def test_pack_is_deterministic_complete_and_within_budget():
    for window in (1, 64, 256):
        a = [[s.index for s in g] for g in pack(samples(), 16384, window)]
        b = [[s.index for s in g] for g in pack(samples(), 16384, window)]
        assert a == b
        flat = [i for g in a for i in g]
        assert sorted(flat) == list(range(600))
        sizes = {i: len(s) for i, s in enumerate(samples())}
        assert all(sum(sizes[i] for i in g) <= 16384 for g in a)
        assert len({g[0] for g in a}) == len(a)  # the first sample names a chunk uniquely (chunk ids)


def test_sorting_windows_cut_padding():
    unsorted = padding_fraction(pack(samples(), 16384, 1), 16384, 64)
    windowed = padding_fraction(pack(samples(), 16384, 256), 16384, 64)
    assert windowed < unsorted / 3, (unsorted, windowed)


def test_chunk_json_round_trip_and_micro_batches():
    chunk = Chunk("r-e0-x-000000000-000000002", 0, samples(3))
    back = Chunk.from_json(chunk.to_json())
    assert [len(s) for s in back.samples] == [len(s) for s in chunk.samples]
    assert [s.index for s in back.samples] == [0, 1, 2]
    batches = micro_batches([10, 30, 20], 60)
    assert batches == [[1, 2], [0]]  # longest first; 2 rows x 30 <= 60


def test_power_of_two_rows_repeat_shapes_without_adding_padding():
    lengths = [len(s) for s in samples(n=300)]
    plain = micro_batches(lengths, 16384)
    bucketed = micro_batches(lengths, 16384, power_of_two_rows=True)
    assert sorted(i for b in bucketed for i in b) == list(range(300))  # every sample exactly once
    assert all(len(b) & (len(b) - 1) == 0 for b in bucketed)  # 1, 2, 4, ... rows
    assert all(len(b) * lengths[b[0]] <= 16384 for b in bucketed)
    assert any(len(b) & (len(b) - 1) for b in plain)  # without buckets, row counts are whatever fits
    assert micro_batches([10] * 13, 1000, power_of_two_rows=True) == [list(range(8)), list(range(8, 12)), [12]]
    # smaller batches are each padded to their own longest sample: no more padding than the greedy batching
    chunks = list(pack(samples(), 16384, 256))
    assert padding_fraction(chunks, 16384, 64, power_of_two_rows=True) <= padding_fraction(chunks, 16384, 64)


def test_a_chunk_id_names_its_sample_range():
    """The run and fingerprint may hold dashes; the id's last two fields are still the range it was made from."""
    assert sample_range(chunk_id("my-run", "ab-cd" * 4, 3, 7, 123456)) == (7, 123456)
