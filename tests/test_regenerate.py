"""Regeneration with the tiny target: the transformers engine killed and resumed in a real process, left-padded
batches equal to unbatched greedy decoding, the endpoint engine against a real HTTP server that fails on purpose,
and the settings that reach the engines."""

from __future__ import annotations

import collections
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from dflashq import defaults, settings as S
from dflashq.exceptions import ConfigError, DflashqError, InputError
from dflashq.target import load_target
from producers.conversation import normalize
from producers.engine_processes import EngineProcesses
from producers.engines import EndpointEngine, TransformersEngine
from producers.regenerate import record_key, regenerate
from producers import decode_batches, static_decoder
from producers.static_decoder import StaticDecoder
from trainer.evaluate import greedy_generate
from workers.tiny_model import EOS_ID, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
MAX_NEW = 6


class Target:
    """The tiny target's own turns the plain way: chat template, then unbatched greedy decoding with its cache."""

    def __init__(self, path: str):
        self.model = load_target(path, "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.eos_ids = {EOS_ID, self.tokenizer.eos_token_id}
        self.lock = threading.Lock()  # the HTTP server's threads share the model

    def prompt_ids(self, messages, tools=None, enable_thinking=True) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=enable_thinking)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def reply(self, messages, tools=None, max_new_tokens=MAX_NEW, enable_thinking=True) -> tuple[str, int, bool]:
        """The next assistant turn's text, its token count and whether it was cut at max_new_tokens."""
        ids = self.prompt_ids(messages, tools, enable_thinking)
        with self.lock:
            tokens = greedy_generate(self.model, ids, max_new_tokens, self.eos_ids)
        return self.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), tokens[-1] not in self.eos_ids

    def regenerated(self, record: dict, max_new_tokens=MAX_NEW) -> list[dict]:
        """What regeneration must write: the source's other turns, each assistant turn made from the new history."""
        conversation = normalize(record)
        messages = []
        for message in conversation.messages:
            if message["role"] == "assistant":
                message = {"role": "assistant", "content": self.reply(messages, conversation.tools, max_new_tokens)[0]}
            messages.append(message)
        return messages


@pytest.fixture(scope="module")
def target(tiny_qwen35) -> Target:
    target = Target(tiny_qwen35)
    target.reply([{"role": "user", "content": "warm up"}])  # the first forward is slow; no request may time out on it
    return target


def chat(*turns: str, **extra) -> dict:
    """user, assistant, user, assistant... from the given texts."""
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)], **extra}


def read_jsonl(path) -> list[dict]:
    """The complete lines of a JSONL file (a line still being written is not)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines(keepends=True) if line.endswith("\n")]


def before_first_reply(record: dict) -> list[dict]:
    messages = normalize(record).messages
    return messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]


def table_value(stdout: str, label: str) -> str:
    """A row's value in the summary table the command prints."""
    return re.search(rf"{label}\s*│\s*(.*?)\s*│", stdout).group(1)


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", "regenerate", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=env)


# --- the transformers engine --------------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_run_resumes_without_losing_or_doubling_a_record(tmp_path, tiny_qwen35, target):
    good = []
    for i in range(16):
        record = chat(f"Question {i}: tell me about " + "the sea " * (i % 5), f"an old answer {i}", id=f"r{i}")
        if i % 4 == 0:  # multi-turn, some keyed by their content instead of an id
            record = chat(f"Question {i}", "old 1", f"And then {i}?", "old 2", **({} if i % 8 else {"id": f"r{i}"}))
        good.append(record)
    lines = [json.dumps(r) for r in good]
    bad = {  # 1-based line number in the file -> the reason's words
        len(lines) + 1: ("malformed JSON", '{"messages": [{"role": "user"'),
        len(lines) + 2: ("no assistant turn", json.dumps({"messages": [{"role": "user", "content": "only this"}]})),
        len(lines) + 3: ("pre-tokenized", json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})),
        len(lines) + 4: ("no messages", json.dumps({"text": "an unknown format"})),
    }
    lines += [line for _, line in bad.values()]
    lines.append(json.dumps(good[3]))  # the same key again: written once
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    config = tmp_path / "run.toml"
    # one conversation per generate call (no two fit in 8 tokens), four per write: several fsynced writes
    config.write_text(f'[model]\npath = "{tiny_qwen35}"\n[data]\npaths = ["{data}"]\n'
                      f'[regenerate]\nmax_new_tokens = {MAX_NEW}\nbatch_tokens = 8\n')
    out = tmp_path / "out" / "regenerated.jsonl"
    command = [sys.executable, "-m", "ops.cli", "regenerate", "--config", str(config), "--out", str(out),
               "--engine", "transformers", "--device", "cpu", "--no-progress"]
    with open(tmp_path / "stderr", "wb") as stderr:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        while proc.poll() is None and not (out.exists() and out.read_bytes().count(b"\n") >= 4):
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    written = read_jsonl(out)
    keys = [record_key(r) for r in good]
    assert 4 <= len(written) < len(good)
    pending = next(k for k in keys if k not in {w["id"] for w in written})
    with open(out, "a") as f:  # a crash in the middle of writing a line
        f.write(json.dumps({"id": pending, "source": "x", "messages": []})[:25])

    rerun = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert table_value(rerun.stdout, "torn last line") == "cut off and redone"
    assert table_value(rerun.stdout, "already done") == str(len(written))
    assert table_value(rerun.stdout, "duplicates") == "1" and table_value(rerun.stdout, "rejected") == "4"
    lines_out = read_jsonl(out)
    assert [line["id"] for line in lines_out][: len(written)] == [w["id"] for w in written]  # appended, never rewritten
    assert sorted(line["id"] for line in lines_out) == sorted(keys)  # every record once, the duplicate too
    by_key = {line["id"]: line for line in lines_out}
    for number, (record, key) in enumerate(zip(good, keys), start=1):
        assert by_key[key]["source"] == f"{data}:{number}"
        assert by_key[key]["messages"] == target.regenerated(record), number
    # the second turn came from the regenerated first one, not from the dataset's
    multi = by_key[keys[0]]["messages"]
    assert [m["content"] for m in multi[::2]] == ["Question 0", "And then 0?"]
    assert multi[3]["content"] != target.reply(good[0]["messages"][:3])[0]
    rejects = read_jsonl(tmp_path / "out" / "regenerated.rejects.jsonl")
    assert [r["source"] for r in rejects] == [f"{data}:{n}" for n in bad]
    for reject, (words, _) in zip(rejects, bad.values()):
        assert words in reject["reason"]
    assert read_jsonl(tmp_path / "out" / "regenerated.failed.jsonl") == []


@pytest.mark.slow
def test_engine_processes_answer_as_one_engine_does(tmp_path, tiny_qwen35, target):
    """`--processes 2`: two engine processes share the device; the output is the same target's greedy turns, one
    line per record, and a killed engine process ends the run with one sentence, keeping the records done."""
    records = [chat(f"Question {i} " + "about the sea " * (i % 4), "old", id=f"r{i}") for i in range(7)]
    records[2] = chat("First", "old 1", "Second?", "old 2", id="r2")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{tiny_qwen35}"\n[regenerate]\nmax_new_tokens = {MAX_NEW}\nbatch_tokens = 64\n')
    out = tmp_path / "regenerated.jsonl"
    done = cli(data, "--config", config, "--out", out, "--device", "cpu", "--processes", "2", "--no-progress")
    assert done.returncode == 0, done.stderr
    written = {w["id"]: w for w in read_jsonl(out)}
    assert sorted(written) == sorted(f"r{i}" for i in range(7))
    for i, record in enumerate(records):
        assert written[f"r{i}"]["messages"] == target.regenerated(record), i

    settings = S.load(str(config), [], environ={})
    engine = EngineProcesses(settings, "cpu", 2)
    try:
        history = normalize(chat("Still there?", "old"))
        history.messages.pop()
        assert [r.content for r in engine.respond([history, history])] == [target.reply(history.messages)[0]] * 2
        engine._children[1][0].kill()
        with pytest.raises(DflashqError, match="regenerate engine process 1 died"):
            engine.respond([history, history])
    finally:
        engine.close()


@pytest.mark.slow
def test_left_padded_batches_equal_unbatched_greedy_for_every_input_format(tmp_path, tiny_qwen35, target):
    jsonl = tmp_path / "a.jsonl"
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    with_tool = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                              {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "content": "sunny, 21 C"},
                              {"role": "assistant", "content": "It is sunny."}], "tools": tools}
    records = [chat("Hi", "old"), chat("A much longer question about " + "many things " * 12, "old"), with_tool]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    sharegpt = {"system": "You are terse.", "conversations": [{"from": "human", "value": "Name a color"},
                                                              {"from": "gpt", "value": "Red"},
                                                              {"from": "human", "value": "Another one"},
                                                              {"from": "gpt", "value": "Blue"}]}
    (tmp_path / "b.json").write_text(json.dumps([sharegpt]))
    pairs = [{"prompt": "What is 2+2?", "response": "4"}, {"prompt": "Say something " * 5, "response": "ok"}]
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "c.parquet")
    inputs = [str(jsonl), str(tmp_path / "b.json"), str(tmp_path / "c.parquet")]
    settings = S.load(None, [("model.path", tiny_qwen35), ("regenerate.max_new_tokens", MAX_NEW),
                             ("regenerate.batch_tokens", 4096)], environ={})
    engine = TransformersEngine(settings, "cpu")
    prompts = [before_first_reply(r) for r in records + [sharegpt] + pairs]
    lengths = [len(target.prompt_ids(m, tools if i == 2 else None)) for i, m in enumerate(prompts)]
    assert len(set(lengths)) > 1 and len(lengths) * (max(lengths) + MAX_NEW) <= 4096  # one left-padded batch

    out = tmp_path / "regenerated.jsonl"
    report = regenerate(settings, inputs, str(out), engine, progress=False)
    assert (report.records, report.regenerated, report.rejected, report.failed) == (6, 6, 0, 0)
    assert report.tokens == report.truncated_turns * MAX_NEW > 0  # the random target never ends a turn by itself
    # lines come in the order records finish: single-turn ones after the first call, the two-turn chat after the second
    written = read_jsonl(out)
    assert [w["source"] for w in written][-1] == f"{inputs[1]}#0"
    order = [f"{jsonl}:1", f"{jsonl}:2", f"{jsonl}:3", f"{inputs[1]}#0", f"{inputs[2]}#0", f"{inputs[2]}#1"]
    written.sort(key=lambda w: order.index(w["source"]))
    assert [w["source"] for w in written] == order
    for line, record in zip(written, records + [sharegpt] + pairs):
        assert line["messages"] == target.regenerated(record)
        assert line["id"] == record_key(record)
    assert written[2]["tools"] == tools and written[2]["messages"][2] == {"role": "tool", "content": "sunny, 21 C"}
    assert written[3]["messages"][0] == {"role": "system", "content": "You are terse."}
    assert [m["content"] for m in written[3]["messages"] if m["role"] == "user"] == ["Name a color", "Another one"]


@pytest.mark.slow
def test_a_long_chat_shares_engine_calls_with_the_records_after_it(tmp_path, tiny_qwen35, target):
    # rows of 1 and BATCHES_PER_CALL (4) histories per call: a 4-turn chat and five 1-turn ones make 9 turns
    settings = S.load(None, [("model.path", tiny_qwen35), ("regenerate.max_new_tokens", MAX_NEW),
                             ("regenerate.batch_tokens", MAX_NEW)], environ={})
    engine = TransformersEngine(settings, "cpu")
    assert engine.batch_size == 4
    calls = []
    respond = engine.respond
    engine.respond = lambda histories: calls.append(len(histories)) or respond(histories)
    records = [chat("u1", "a", "u2", "a", "u3", "a", "u4", "a")] + [chat(f"single {i}", "a") for i in range(5)]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = regenerate(settings, [str(data)], str(tmp_path / "out.jsonl"), engine, progress=False)
    assert report.regenerated == 6 and calls == [4, 3, 1, 1]  # the pool refills while the long chat goes on
    written = {w["source"]: w for w in read_jsonl(tmp_path / "out.jsonl")}
    assert [w["source"] for w in read_jsonl(tmp_path / "out.jsonl")][-1] == f"{data}:1"  # written when it finished
    for number, record in enumerate(records, 1):
        assert written[f"{data}:{number}"]["messages"] == target.regenerated(record)


@pytest.mark.slow
def test_a_batch_out_of_memory_is_split_and_answers_the_same(tiny_qwen35, target):
    import torch

    settings = S.load(None, [("model.path", tiny_qwen35), ("regenerate.max_new_tokens", MAX_NEW)], environ={})
    engine = TransformersEngine(settings, "cpu")
    generate, tried, ran = engine.model.generate, [], []

    def small_batches_only(input_ids, **kwargs):
        tried.append(input_ids.shape[0])
        if input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("simulated")
        ran.append(input_ids.shape[0])
        return generate(input_ids=input_ids, **kwargs)

    engine.model.generate = small_batches_only
    histories = [normalize(chat(f"question number {i} " * (i + 1), "a")) for i in range(5)]
    for history in histories:
        history.messages.pop()  # ends where the target speaks
    replies = engine.respond(histories)
    assert tried[:3] == [5, 2, 3] and sorted(ran) == [1, 2, 2]  # halves, split again until each fits
    assert [r.content for r in replies] == [target.reply(h.messages)[0] for h in histories]


def _tiny_qwen3(path: Path) -> str:
    """A tiny Qwen3 (per-head q/k norms, 2 query heads per key/value head) with the llama test model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    llama = write_tiny_model(str(path / "llama"), "llama")
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=load_target(llama, "cpu").config.vocab_size, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512)
    Qwen3ForCausalLM(config).save_pretrained(path / "qwen3")
    for name in os.listdir(llama):
        if "token" in name or name.endswith(".jinja"):
            shutil.copyfile(os.path.join(llama, name), path / "qwen3" / name)
    return str(path / "qwen3")


def _plan_cost(runs, lengths, new, fixed):
    return sum(fixed + (end - start) * (lengths[start] + new) for start, end in runs)


def test_decode_batches_plan_is_the_least_cost_cut_within_the_limits():
    """The plan covers the sorted prompts in order, keeps every batch within the row cap and the KV budget (a lone
    prompt always goes), and costs exactly what the best of every possible cut costs (all 2^(n-1) tried)."""
    generator = random.Random(0)
    for _ in range(200):
        lengths = sorted((generator.randint(1, 300) for _ in range(generator.randint(1, 9))), reverse=True)
        new, budget, rows, fixed = (generator.randint(1, 50), generator.randint(50, 2000), generator.randint(1, 6),
                                    generator.randint(0, 500))
        runs = decode_batches.plan(lengths, new, budget, rows, fixed)
        assert [start for start, _ in runs] == [0] + [end for _, end in runs[:-1]] and runs[-1][1] == len(lengths)
        assert all(end - start <= rows and (end - start == 1 or (end - start) * (lengths[start] + new) <= budget)
                   for start, end in runs)
        costs = []
        for mask in range(1 << (len(lengths) - 1)):
            cuts = [0] + [i + 1 for i in range(len(lengths) - 1) if mask >> i & 1] + [len(lengths)]
            cut = list(zip(cuts, cuts[1:]))
            if all(e - s <= rows and (e - s == 1 or (e - s) * (lengths[s] + new) <= budget) for s, e in cut):
                costs.append(_plan_cost(cut, lengths, new, fixed))
        assert _plan_cost(runs, lengths, new, fixed) == min(costs)
    with pytest.raises(ValueError, match="longest first"):
        decode_batches.plan([1, 2], 4, 100, 4, 0)


def test_decode_batches_keep_short_prompts_off_a_long_ones_padding():
    """A few long multi-turn histories among many short first turns: filling batches up to the KV budget padded
    hundreds of short rows to the longest (the H100 run in producers/decode_batches.py); the plan gives the long ones
    their own batch, and equal prompts stay in as few batches as the row cap allows."""
    lengths = [2800, 2600, 2500] + [300] * 1000
    runs = decode_batches.plan(lengths, 256, 1_460_728, 1024, defaults.REGENERATE_BATCH_FIXED_TOKENS)
    assert runs == [(0, 3), (3, 1003)]
    assert len(decode_batches.plan([64] * 2500, 256, 10**9, 1024, 200_000)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_decoder_decodes_as_generate_does(tmp_path, arch, monkeypatch):
    """The static-cache decoder (its eager step, which a GPU replays as a CUDA graph) gives each left-padded row of
    a batch the same greedy tokens as Transformers' generate, up to the row's end id, on Llama and Qwen3 layouts."""
    path = write_tiny_model(str(tmp_path / "llama"), "llama") if arch == "llama" else _tiny_qwen3(tmp_path)
    model = load_target(path, "cpu")
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(10, 1000, (n,), generator=generator).tolist() for n in (9, 3, 17, 1, 12)]
    new = 24
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[:, width:].tolist()
    eos = expected[1][5]  # a token some row emits: that row's output ends there, the others run on
    decoded = StaticDecoder(model, new, {eos}, pad_id=0).decode(rows)

    def upto_end(tokens):
        return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens

    assert [upto_end(t) for t in decoded] == [upto_end(t) for t in expected]
    assert all(len(t) == new for t in decoded) and len(upto_end(decoded[1])) <= 6
    monkeypatch.setattr(static_decoder, "PROMPT_TOKENS", 2 * width)  # prompts in slices of two rows: the same
    assert StaticDecoder(model, new, {eos}, pad_id=0).decode(rows) == decoded


@pytest.mark.slow
def test_static_decoder_in_the_engine(tmp_path, tiny_qwen35):
    """regenerate.decoder = "static" answers every history with the target's own greedy turn, in order; a hybrid
    target or a sampling temperature, which it cannot decode, is refused in one sentence naming the setting."""
    llama = write_tiny_model(str(tmp_path / "llama"), "llama")
    plain = Target(llama)
    histories = [normalize(chat(f"question number {i} " * (i + 1), "a")) for i in range(6)]
    for history in histories:
        history.messages.pop()  # ends where the target speaks
    settings = S.load(None, [("model.path", llama), ("regenerate.max_new_tokens", MAX_NEW),
                             ("regenerate.batch_tokens", 256), ("regenerate.decoder", "static")], environ={})
    engine = TransformersEngine(settings, "cpu")
    assert engine.static is not None
    replies = engine.respond(histories)
    assert [(r.content, r.tokens, r.truncated, r.error) for r in replies] == \
        [(*plain.reply(h.messages), None) for h in histories]
    assert TransformersEngine(S.load(None, [("model.path", llama)], environ={}), "cpu").static is None  # auto: GPU only
    for path, extra, why in ((tiny_qwen35, [], "its architecture .qwen3_5_text. is not one of llama, mistral, qwen2, qwen3"),
                             (llama, [("regenerate.temperature", 0.7)], "regenerate.temperature is above 0")):
        refused = S.load(None, [("model.path", path), ("regenerate.decoder", "static"), *extra], environ={})
        with pytest.raises(ConfigError, match=f"regenerate.decoder = 'static' cannot decode .*{why}; set it to 'auto'"):
            TransformersEngine(refused, "cpu")
    with pytest.raises(ConfigError, match="regenerate.decoder must be"):
        S.load(None, [("regenerate.decoder", "fast")], environ={})


def test_kv_bytes_count_only_the_layers_that_cache_keys(tiny_qwen35, tmp_path):
    from producers.engines import auto_batch_tokens, kv_bytes_per_token
    from workers.tiny_model import write_tiny_model

    for path in (tiny_qwen35, write_tiny_model(str(tmp_path / "llama"), "llama")):
        model = load_target(path, "cpu")
        config = model.config.get_text_config()
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        cached = sum(t != "linear_attention" for t in types)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert kv_bytes_per_token(model) == 2 * cached * config.num_key_value_heads * head_dim * 4  # fp32 on the CPU
        assert auto_batch_tokens(model, model.device) == 65536  # the CPU's fixed budget
    assert "linear_attention" in load_target(tiny_qwen35, "cpu").config.get_text_config().layer_types


# --- the endpoint engine ------------------------------------------------------------------------------------
class ChatServer(ThreadingHTTPServer):
    """An OpenAI-compatible chat-completions server answering with the tiny target's greedy turns, failing on purpose
    once for prompts containing inject-500, inject-429, inject-slow and inject-malformed, and always for always-fail
    while `failing` is set."""

    daemon_threads = True

    def __init__(self, target: Target, slow_seconds: float):
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.target, self.slow_seconds, self.failing = target, slow_seconds, True
        self.lock = threading.Lock()
        self.attempts: collections.Counter = collections.Counter()  # per exact request body
        self.bodies: list[dict] = []
        self.authorizations: list[str | None] = []
        self.clients: set = set()  # (host, port) of each connection: a kept client reuses them
        self.models_requests = 0
        self.in_flight = self.max_in_flight = 0
        self.errors: list[BaseException] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address):
        self.errors.append(sys.exc_info()[1])


class ChatHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM and SGLang serve

    def log_message(self, *args):
        pass

    def send(self, status: int, payload: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow answer
            pass

    def do_GET(self):
        server: ChatServer = self.server
        with server.lock:
            server.models_requests += 1
        self.send(200, json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode())

    def do_POST(self):
        server: ChatServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = json.dumps(body["messages"])
        with server.lock:
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            server.attempts[key] += 1
            first = server.attempts[key] == 1
            server.bodies.append(body)
            server.authorizations.append(self.headers.get("Authorization"))
            server.clients.add(self.client_address)
        try:
            self.answer(server, body, key, first)
        finally:
            with server.lock:
                server.in_flight -= 1

    def answer(self, server: ChatServer, body: dict, key: str, first: bool) -> None:
        if "inject-500" in key and first:
            return self.send(500, b'{"error": "internal"}')
        if "inject-429" in key and first:
            return self.send(429, b'{"error": "slow down"}')
        if "inject-malformed" in key and first:
            return self.send(200, b'{"choices": [{"message": ')
        if "always-fail" in key and server.failing:
            return self.send(503, b'{"error": "overloaded"}')
        if "inject-slow" in key and first:
            time.sleep(server.slow_seconds)
        assert body["model"] == "tiny"
        content, tokens, truncated = server.target.reply(
            body["messages"], body.get("tools"), body["max_tokens"], body["chat_template_kwargs"]["enable_thinking"])
        self.send(200, json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "length" if truncated else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
        }).encode())


@pytest.fixture
def chat_server(target):
    server = ChatServer(target, slow_seconds=3.5)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    assert server.errors == []


@pytest.mark.slow
def test_endpoint_retries_until_complete_and_records_what_keeps_failing(tmp_path, target, chat_server):
    records = [chat(f"plain question {i}", "old", id=f"p{i}") for i in range(5)]
    records += [chat(f"{name} please", "old", id=name) for name in ("inject-500", "inject-429", "inject-slow", "inject-malformed")]
    records.append(chat("inject-500 in turn one", "old", "and a second question", "old", id="multi"))
    records.append(chat("always-fail", "old", id="doomed"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = S.load(None, [("regenerate.max_new_tokens", MAX_NEW), ("regenerate.concurrency", 4),
                             ("regenerate.timeout_seconds", 3), ("regenerate.retries", 2)], environ={})
    out = tmp_path / "regenerated.jsonl"
    with EndpointEngine(chat_server.url + "/v1/", settings.regenerate) as engine:
        assert engine.model == "tiny" and chat_server.models_requests == 1
        report = regenerate(settings, [str(data)], str(out), engine, progress=False)
    assert (report.regenerated, report.failed, report.rejected) == (len(records) - 1, 1, 0)
    written = {line["id"]: line["messages"] for line in read_jsonl(out)}
    assert set(written) == {r["id"] for r in records} - {"doomed"}
    for record in records[:-1]:
        assert written[record["id"]] == target.regenerated(record), record["id"]
    injected = [n for body, n in chat_server.attempts.items() if "inject-" in body]
    assert injected == [2] * 6  # each failed once, then answered (both turns of "multi" too)
    assert [n for body, n in chat_server.attempts.items() if "always-fail" in body] == [3]  # 1 + retries
    (failure,) = read_jsonl(tmp_path / "regenerated.failed.jsonl")
    assert failure["id"] == "doomed" and failure["source"] == f"{data}:{len(records)}"
    assert "HTTP 503" in failure["reason"] and "after 2 retries" in failure["reason"]
    assert chat_server.max_in_flight > 1  # --concurrency really overlaps requests
    assert len(chat_server.clients) < len(chat_server.bodies)  # over kept connections
    assert report.tokens == report.truncated_turns * MAX_NEW == 11 * MAX_NEW  # usage counted; no turn ends by itself

    chat_server.failing = False
    with EndpointEngine(chat_server.url, settings.regenerate) as engine:
        rerun = regenerate(settings, [str(data)], str(out), engine, progress=False)
    assert (rerun.already_done, rerun.regenerated, rerun.failed) == (len(records) - 1, 1, 0)
    lines = read_jsonl(out)
    assert len(lines) == len(records) and lines[-1]["id"] == "doomed"
    assert lines[-1]["messages"] == target.regenerated(records[-1])
    assert read_jsonl(tmp_path / "regenerated.failed.jsonl") == []


# --- settings and user errors -------------------------------------------------------------------------------
@pytest.mark.slow
def test_settings_reach_the_endpoint(tmp_path, chat_server):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(chat("Hello", "old")) + "\n")
    env = dict(os.environ, DFLASHQ_REGENERATE_SERVED_MODEL="tiny", DFLASHQ_REGENERATE_API_KEY="s3cret")
    proc = cli(data, "--out", tmp_path / "o.jsonl", "--endpoint", chat_server.url, "--no-progress", "--concurrency", 2,
               "--set", "regenerate.max_new_tokens=3", "--set", "regenerate.enable_thinking=false", env=env)
    assert proc.returncode == 0, proc.stderr
    (body,) = chat_server.bodies
    assert (body["max_tokens"], body["temperature"], body["chat_template_kwargs"]) == (3, 0.0, {"enable_thinking": False})
    assert chat_server.models_requests == 0  # the served model came from the environment
    assert chat_server.authorizations == ["Bearer s3cret"]  # a server started with --api-key lets it in
    assert table_value(proc.stdout, "regenerated") == "1"


@pytest.mark.parametrize("key, value, words", [
    ("regenerate.max_new_tokens", "0", "regenerate.max_new_tokens must be at least 1"),
    ("regenerate.temperature", "-0.5", "regenerate.temperature must be 0"),
    ("regenerate.concurrency", "0", "regenerate.concurrency must be at least 1"),
    ("regenerate.timeout_seconds", "0", "regenerate.timeout_seconds must be more than 0"),
    ("regenerate.retries", "-1", "regenerate.retries must be 0 or more"),
    ("regenerate.batch_tokens", "-1", "regenerate.batch_tokens must be at least 1"),
    ("regenerate.batch_fixed_tokens", "-1", "regenerate.batch_fixed_tokens must be 0 or more"),
    ("regenerate.enable_thinking", "maybe", "not a valid bool"),
    ("regenerate.max_new_tokens", "many", "not a valid int"),
])
def test_invalid_settings_are_one_sentence(key, value, words):
    with pytest.raises(ConfigError) as info:
        S.load(None, [(key, value)], environ={})
    assert words in str(info.value) and "\n" not in str(info.value)
    env_name = "DFLASHQ_" + key.replace(".", "_").upper()
    with pytest.raises(ConfigError):
        S.load(None, environ={env_name: value})


def test_a_second_run_on_the_same_output_is_refused(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(chat("Hello", "old")) + "\n")
    out = tmp_path / "o.jsonl"
    settings = S.load(None, [("regenerate.served_model", "tiny")], environ={})  # so the engine connects to nothing yet
    with open(out, "ab") as held, EndpointEngine("http://127.0.0.1:1", settings.regenerate) as engine:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `dflashq regenerate` holds it
        with pytest.raises(InputError, match="being written by another"):
            regenerate(settings, [str(data)], str(out), engine, progress=False)
    assert out.read_bytes() == b"" and not (tmp_path / "o.rejects.jsonl").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["data.jsonl", "--out", "o.jsonl", "--set", "regenerate.concurrency=0"], "regenerate.concurrency must be at least 1"),
    (["data.jsonl", "--out", "o.jsonl", "--set", "regenerate.retries=0", "--endpoint", f"http://127.0.0.1:{free_port()}"],
     "fix --endpoint"),
    (["data.jsonl", "--out", "o.txt"], "must end in .jsonl"),
    (["nope.jsonl", "--out", "o.jsonl"], "nope.jsonl does not exist"),
    (["data.txt", "--out", "o.jsonl"], "data.txt has an unknown format"),
    (["data.jsonl", "--out", "o.jsonl", "--model", "no-model"], "no-model does not exist"),
])
def test_cli_user_errors_are_one_sentence(tmp_path, args, words):
    for name in ("data.jsonl", "data.txt"):
        (tmp_path / name).write_text(json.dumps(chat("Hello", "old")) + "\n")
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "regenerate", *args], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
