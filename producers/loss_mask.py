"""Rendering a conversation with the tokenizer's chat template and masking exactly the assistant tokens.

Template-agnostic: assistant turn i starts where render(messages[:i], add_generation_prompt=True) ends (so the
role header is never supervised) and ends after the template's end-of-turn marker (which the model must learn
to emit). The marker is found once per tokenizer from a probe conversation. Only text is re-rendered per turn;
the full text is tokenized once, and tokens whose character span lies inside an assistant span are masked.
What is masked is what the template renders: Qwen3, for instance, drops <think> blocks before the last user
query and keeps them after it, and the mask follows.
"""

from __future__ import annotations

import weakref

import jinja2
import numpy as np

from dflashq.exceptions import InputError, RejectedSample
from producers.conversation import Conversation

PROBE_QUERY = "dflashq probe query"
PROBE_REPLY = "dflashq probe reply"

_markers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def end_of_turn_marker(tokenizer) -> str:
    """The text the chat template puts right after an assistant reply to end the turn (cached per tokenizer)."""
    marker = _markers.get(tokenizer)
    if marker is None:
        marker = _markers[tokenizer] = _probe_marker(tokenizer)
    return marker


def _probe_marker(tokenizer) -> str:
    if not tokenizer.chat_template:
        raise InputError(
            f"The tokenizer in {tokenizer.name_or_path} has no chat template; add one or use pre-tokenized data."
        )
    query = [{"role": "user", "content": PROBE_QUERY}]
    try:
        prompt = _render(tokenizer, query, None, add_generation_prompt=True)
        full = _render(tokenizer, query + [{"role": "assistant", "content": PROBE_REPLY}], None, False)
    except RejectedSample as exc:
        raise InputError(
            f"The chat template of {tokenizer.name_or_path} fails on a plain user/assistant exchange ({exc.reason})."
        ) from None
    reply_end = full.rfind(PROBE_REPLY) + len(PROBE_REPLY)
    if not full.startswith(prompt) or reply_end - len(PROBE_REPLY) < len(prompt):
        raise InputError(
            f"The chat template of {tokenizer.name_or_path} does not put the reply after its generation prompt."
        )
    tail = full[reply_end:]
    # The first added (control) token after the reply ends the turn; what follows it (a newline, a BOS of the
    # next turn) is the template's glue, which the model never emits.
    encoding = tokenizer.backend_tokenizer.encode(tail, add_special_tokens=False)
    added = tokenizer.added_tokens_decoder
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
        if token_id in added:
            return tail[start:end]
    if not tail.strip():
        raise InputError(
            f"The chat template of {tokenizer.name_or_path} marks no end of an assistant turn; use pre-tokenized data."
        )
    return tail.strip()


def render_and_mask(tokenizer, conversation: Conversation) -> tuple[np.ndarray, np.ndarray]:
    """input_ids [T] int32 and loss_mask [T] uint8 (1 on assistant content and end-of-turn tokens).

    Raises RejectedSample for a conversation the template cannot render or that cannot be masked reliably."""
    marker = end_of_turn_marker(tokenizer)
    messages, tools = conversation.messages, conversation.tools
    for message in messages:
        if message["role"] == "assistant" and marker in message["content"] + message.get("reasoning_content", ""):
            raise RejectedSample("assistant content contains the end-of-turn marker")
    text = _render(tokenizer, messages, tools, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
        if not text.startswith(prefix):
            raise RejectedSample("chat template renders turns inconsistently")
        end = text.find(marker, len(prefix))
        if end < 0:
            raise RejectedSample("assistant turn has no end-of-turn marker")
        spans.append((len(prefix), end + len(marker)))
    try:
        # add_special_tokens=False: the template renders BOS itself
        encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # the Rust tokenizer refuses strings with lone surrogates (from "\ud800" JSON escapes)
        raise RejectedSample("text is not valid Unicode") from None
    input_ids = np.array(encoding.ids, dtype=np.int32)
    offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    inside = np.zeros(len(input_ids), dtype=bool)
    for start, end in spans:
        inside |= (offsets[:, 0] >= start) & (offsets[:, 1] <= end)
    return input_ids, inside.astype(np.uint8)


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise RejectedSample(f"chat template error: {exc}") from None
