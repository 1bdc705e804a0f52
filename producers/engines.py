"""The engines that write the target's own assistant turns, behind one interface.

An Engine answers a batch of chat histories (each ends where the target speaks next) with one Reply per history,
in order. TransformersEngine runs the target here, loaded through the contract loader (dflashq.target);
EndpointEngine asks an OpenAI-compatible chat-completions server (vLLM, SGLang) that serves it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import gc
import threading
from typing import Protocol

import httpx
import jinja2
import torch

from dflashq import defaults
from dflashq.exceptions import ConfigError, InputError
from dflashq.settings import RegenerateSettings, Settings
from dflashq.target import eos_ids, load_target
from producers import decode_batches
from producers.conversation import Conversation
from producers.static_decoder import StaticDecoder, left_padded, unsupported_reason
from producers.tokenize import load_tokenizer

# Conversations handed over per respond() call, in engine batches (GPU batches, or requests in flight): enough that
# the transformers engine can sort by length and an endpoint stays busy while the slowest request of a call finishes,
# few enough that a crash loses little (the driver writes and fsyncs after each call's records are done).
BATCHES_PER_CALL = 4
BACKOFF_SECONDS = 0.5  # the wait before an endpoint request's first retry; it doubles with each retry, up to
BACKOFF_MAX_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Reply:
    content: str = ""
    reasoning_content: str | None = None  # a server's reasoning parser splits the thinking off (vLLM, SGLang)
    tool_calls: list[dict] | None = None
    tokens: int = 0  # generated tokens
    truncated: bool = False  # stopped at regenerate.max_new_tokens rather than at the end of the turn
    error: str | None = None  # no response, and why: the record is left for the next run

    def message(self) -> dict:
        message = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class Engine(Protocol):
    batch_size: int  # histories per respond() call that keep the engine busy (BATCHES_PER_CALL engine batches)

    def respond(self, histories: list[Conversation]) -> list[Reply]:
        """The target's next assistant turn after each history, in order; a history it cannot answer gets a Reply
        with `error` set. Raises a DflashqError only when no history can be answered (the run must stop)."""
        ...


def chat_prompts(tokenizer, histories: list[Conversation], enable_thinking: bool
                 ) -> tuple[list[Reply | None], list[tuple[int, list[int]]]]:
    """Each history rendered by the target's chat template up to where it speaks next, as (index, token ids); a
    history the template refuses gets its error Reply at its index instead (the others are None, to be answered)."""
    replies: list[Reply | None] = [None] * len(histories)
    texts = []
    for index, history in enumerate(histories):
        try:
            texts.append((index, tokenizer.apply_chat_template(
                history.messages, tools=history.tools, tokenize=False, add_generation_prompt=True,
                enable_thinking=enable_thinking)))
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            replies[index] = Reply(error=f"chat template error: {exc}")
    # one call for the whole pool: the fast tokenizer spreads it over the cores while the device waits
    encoded = tokenizer([text for _, text in texts], add_special_tokens=False)["input_ids"] if texts else []
    return replies, [(index, row) for (index, _), row in zip(texts, encoded)]  # the template renders BOS itself


def decoded_reply(tokenizer, tokens: list[int], eos_ids: set[int]) -> Reply:
    """The Reply of one generated row: cut after its first end-of-turn id (finished rows are padded after it);
    truncated when it has none, i.e. it stopped at regenerate.max_new_tokens."""
    end = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    kept = tokens if end is None else tokens[: end + 1]
    # skip_special_tokens drops the end-of-turn token, which the chat template adds back when rendering the turn
    content = tokenizer.decode(kept, skip_special_tokens=True)
    return Reply(content, tokens=len(kept), truncated=end is None)


# --- Transformers, on a local device ----------------------------------------------------------------------
class TransformersEngine:
    """The target from model.path on one device: length-sorted, left-padded batches, cut where padding would cost
    more than another batch (producers/decode_batches.py), each bounded by regenerate.batch_tokens (rows x (longest
    prompt + max_new_tokens), i.e. its KV cache; 0 sizes it from the device's free memory) and regenerate's row cap,
    each decoded by the static-cache decoder or by Transformers' generate (regenerate.decoder). A batch that still
    runs out of memory is split."""

    def __init__(self, settings: Settings, device: str = "cpu", memory_share: float = 1.0):
        self.options = settings.regenerate
        model = settings.model
        self.tokenizer = load_tokenizer(model.path, model.trust_remote_code)
        if not self.tokenizer.chat_template:
            raise InputError(f"The tokenizer in {model.path} has no chat template; add one to regenerate with it.")
        self.model = load_target(model.path, device, model.dtype, model.trust_remote_code)
        self.device = next(self.model.parameters()).device
        self.eos_ids = eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)  # padding is masked: any id does
        self.generation_config = self._generation_config()
        self.batch_tokens = self.options.batch_tokens or auto_batch_tokens(self.model, self.device, memory_share)
        self.static = self._static_decoder(model.path)
        rows = max(1, min(defaults.REGENERATE_MAX_ROWS, self.batch_tokens // self.options.max_new_tokens))
        self.batch_size = BATCHES_PER_CALL * rows  # as if prompts were empty

    def __enter__(self) -> TransformersEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Give the target's weights and cached KV blocks back to the device (the process may go on to train)."""
        self.model = self.static = None  # the static decoder holds the cache and the model too
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _static_decoder(self, path: str) -> StaticDecoder | None:
        """regenerate.decoder: the static-cache decoder where it applies ("auto": on a GPU), else None (generate)."""
        choice = self.options.decoder
        reason = unsupported_reason(self.model)
        if reason is None and self.options.temperature > 0:
            reason = "it decodes greedily and regenerate.temperature is above 0"
        if choice == "static" and reason:
            raise ConfigError(f"regenerate.decoder = 'static' cannot decode {path}: {reason}; set it to 'auto' or 'generate'.")
        if choice == "generate" or reason or (choice == "auto" and self.device.type != "cuda"):
            return None
        return StaticDecoder(self.model, self.options.max_new_tokens, self.eos_ids, self.pad_id)

    def _generation_config(self):
        # The checkpoint's own config (eos ids, and top_p / top_k that sampling should keep) with ours on top.
        config = copy.deepcopy(self.model.generation_config)
        if self.options.temperature > 0:
            sampling = {"do_sample": True, "temperature": self.options.temperature}
        else:  # unset the sampling knobs too, or generate warns on every call that greedy ignores them
            sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        config.update(max_new_tokens=self.options.max_new_tokens, pad_token_id=self.pad_id,
                      eos_token_id=sorted(self.eos_ids), **sampling)
        return config

    def respond(self, histories: list[Conversation]) -> list[Reply]:
        replies, prompts = chat_prompts(self.tokenizer, histories, self.options.enable_thinking)
        prompts.sort(key=lambda item: len(item[1]), reverse=True)  # longest first: out of memory shows at once
        for batch in self._batches(prompts):
            for (index, _), reply in zip(batch, self._generate([ids for _, ids in batch])):
                replies[index] = reply
        return replies

    def _batches(self, prompts: list[tuple[int, list[int]]]):
        """The longest-first prompts in consecutive runs of least total cost (producers/decode_batches.py)."""
        runs = decode_batches.plan([len(ids) for _, ids in prompts], self.options.max_new_tokens, self.batch_tokens,
                                   defaults.REGENERATE_MAX_ROWS, self.options.batch_fixed_tokens)
        for start, end in runs:
            yield prompts[start:end]

    def _generate(self, rows: list[list[int]]) -> list[Reply]:
        try:
            generated = self.static.decode(rows) if self.static else self._transformers_generate(rows)
        except torch.OutOfMemoryError:
            if len(rows) == 1:
                raise ConfigError(f"The target ran out of GPU memory on one conversation of {len(rows[0])} tokens: "
                                  f"lower regenerate.max_new_tokens or data.max_length, or use a larger GPU.") from None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(rows) // 2  # the longest rows come first: both halves are about as wide as the whole
            return self._generate(rows[:half]) + self._generate(rows[half:])
        return [decoded_reply(self.tokenizer, tokens, self.eos_ids) for tokens in generated]

    @torch.inference_mode()
    def _transformers_generate(self, rows: list[list[int]]) -> list[list[int]]:
        input_ids, pads = left_padded(rows, self.pad_id)
        width = input_ids.shape[1]
        attention_mask = (torch.arange(width)[None, :] >= pads[:, None]).long()  # [R, width]: 0 on the padding
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  generation_config=self.generation_config)
        return out[:, width:].tolist()


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """K and V of one token in every layer that caches them: linear-attention layers keep a fixed-size state and are
    not counted; sliding-window layers are, as an upper bound."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    layers = sum(t != "linear_attention" for t in layer_types) if layer_types else config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * max(1, layers) * kv_heads * head_dim * next(model.parameters()).element_size()


def auto_batch_tokens(model: torch.nn.Module, device: torch.device, share: float = 1.0) -> int:
    """regenerate.batch_tokens 0: the tokens whose KV cache fills regenerate's share of the GPU's free memory (split
    `share` of it, for one of several engine processes on the device); on the CPU a fixed budget."""
    if device.type != "cuda":
        return defaults.REGENERATE_CPU_BATCH_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(free * defaults.REGENERATE_MEMORY_FRACTION * share) // kv_bytes_per_token(model))


# --- an OpenAI-compatible server --------------------------------------------------------------------------
class RequestFailed(Exception):
    """One request that kept failing (or that the server refuses); `args[0]` says why."""


class EndpointEngine:
    """POST {url}/v1/chat/completions, regenerate.concurrency requests in flight through one kept connection pool.

    Connection errors, timeouts, 5xx, 429 and malformed bodies are retried with exponential backoff up to
    regenerate.retries times; a request that still fails becomes an error Reply. A server that cannot be
    connected to at all stops the run (InputError): every other record would fail the same way."""

    def __init__(self, url: str, options: RegenerateSettings):
        self.url = url.rstrip("/").removesuffix("/v1")  # users paste either form
        self.options = options
        self.batch_size = BATCHES_PER_CALL * options.concurrency
        limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None
        self._client = httpx.Client(base_url=self.url, timeout=options.timeout_seconds, limits=limits, headers=headers)
        self._pool = concurrent.futures.ThreadPoolExecutor(options.concurrency, thread_name_prefix="dflashq-endpoint")
        self._unreachable = threading.Event()  # set by the first request that cannot connect: the others stop retrying
        try:
            self.model = options.served_model or self._first_model()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> EndpointEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._unreachable.set()  # requests still backing off give up at once,
        self._client.close()  # and those in flight (only after a run stopped early) fail at once
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _first_model(self) -> str:
        def first_id(body) -> str:
            return body["data"][0]["id"]

        try:
            return self._call("GET", "/v1/models", None, first_id)
        except RequestFailed as exc:
            raise InputError(f"The endpoint {self.url} lists no model at /v1/models ({exc}): set regenerate.served_model.") from None

    def respond(self, histories: list[Conversation]) -> list[Reply]:
        futures = [self._pool.submit(self._complete, history) for history in histories]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:  # after an unreachable server, what has not started is not sent
                future.cancel()

    def _complete(self, history: Conversation) -> Reply:
        body = {
            "model": self.model,
            "messages": history.messages,
            "max_tokens": self.options.max_new_tokens,
            "temperature": self.options.temperature,
            "chat_template_kwargs": {"enable_thinking": self.options.enable_thinking},
        }
        if history.tools:
            body["tools"] = history.tools
        try:
            return self._call("POST", "/v1/chat/completions", body, _parse_completion)
        except RequestFailed as exc:
            return Reply(error=str(exc))

    def _call(self, method: str, path: str, body: dict | None, parse):
        """parse(the response's JSON), retried as the class says; RequestFailed when it keeps failing."""
        delay = BACKOFF_SECONDS
        for attempt in range(self.options.retries + 1):
            if attempt:
                if self._unreachable.wait(delay):
                    raise RequestFailed(f"{self.url} cannot be reached")
                delay = min(2 * delay, BACKOFF_MAX_SECONDS)
            connect_failed = False
            try:
                response = self._client.request(method, path, json=body)
            except httpx.ConnectError as exc:
                connect_failed, reason = True, f"cannot connect: {exc}"
                continue
            except httpx.TimeoutException:
                reason = f"no response within regenerate.timeout_seconds ({self.options.timeout_seconds:g} s)"
                continue
            except httpx.TransportError as exc:  # the connection broke mid-request
                reason = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                reason = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:  # the server refuses this request itself (e.g. too long): retrying cannot help
                raise RequestFailed(f"HTTP {response.status_code}: {response.text[:500]}")
            try:
                return parse(response.json())
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                reason = f"malformed response body ({type(exc).__name__}: {exc})"
        if connect_failed:
            self._unreachable.set()
            raise InputError(f"The endpoint {self.url} cannot be reached ({reason}): start the server or fix --endpoint.")
        raise RequestFailed(f"{reason} (after {self.options.retries} retries)")


def _parse_completion(body) -> Reply:
    choice = body["choices"][0]
    message = choice["message"]
    content = message.get("content") or ""
    # reasoning parsers put the thinking in reasoning_content (vLLM until 0.10, SGLang) or reasoning (vLLM since)
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    calls = message.get("tool_calls") or None
    if not (isinstance(content, str) and isinstance(reasoning, (str, type(None))) and isinstance(calls, (list, type(None)))):
        raise TypeError("content, reasoning or tool_calls of the wrong type")
    usage = body.get("usage") or {}
    return Reply(content, reasoning, calls, tokens=int(usage.get("completion_tokens") or 0),
                 truncated=choice.get("finish_reason") == "length")
