"""Normalising one dataset record into a chat conversation or a pre-tokenized sample.

Accepted records: `messages` (role/content, optional `reasoning_content` and `tool_calls` on assistant turns),
ShareGPT `conversations` (from/value), `prompt` + `response` (or `completion`) pairs, and pre-tokenized
`input_ids` + `loss_mask`. Anything else raises RejectedSample with a short, stable reason.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from dflashq.exceptions import RejectedSample

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "function_call": "assistant",  # the assistant's call; its value is the call as JSON
    "observation": "tool",  # the call's result
    "tool": "tool",
    "function": "tool",
}


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: list[dict]  # {"role", "content"} (+ "reasoning_content", "tool_calls" on assistant turns)
    tools: list[dict] | None = None  # function schemas the chat template renders into the system prompt


@dataclasses.dataclass(frozen=True)
class Pretokenized:
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8


def normalize(data: dict) -> Conversation | Pretokenized:
    """The record as a checked conversation or pre-tokenized sample; raises RejectedSample."""
    if "input_ids" in data:
        return _pretokenized(data)
    if "messages" in data:
        messages = data["messages"]
    elif "conversations" in data:
        messages = _from_sharegpt(data["conversations"], data.get("system"))
    elif "prompt" in data:
        messages = _from_pair(data)
    else:
        raise RejectedSample("no messages, conversations, prompt or input_ids field")
    return Conversation(_checked(messages), _tools(data.get("tools")))


def _from_sharegpt(turns, system) -> list[dict]:
    if not isinstance(turns, list):
        raise RejectedSample("conversations is not a list")
    messages = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    for turn in turns:
        if not isinstance(turn, dict):
            raise RejectedSample("message is not an object")
        if "from" not in turn:
            raise RejectedSample("message has no role")
        role = SHAREGPT_ROLES.get(turn["from"]) if isinstance(turn["from"], str) else None
        if role is None:
            raise RejectedSample(f"unknown role {turn['from']!r}")
        value = turn.get("value")
        calls = _parsed_calls(value) if turn["from"] == "function_call" else None
        message = {"role": role, "content": "", "tool_calls": calls} if calls else {"role": role, "content": value}
        messages.append(message)
    return messages


def _parsed_calls(value) -> list[dict] | None:
    """A function_call value `{"name", "arguments"}` (or a list of them) as OpenAI-style tool_calls, else None."""
    try:
        calls = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        return None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _from_pair(data: dict) -> list[dict]:
    # a table mixing both columns holds None in the one a row does not use
    response = data.get("response")
    response = data.get("completion") if response is None else response
    if response is None:
        raise RejectedSample("prompt without response or completion")
    system = data.get("system")
    messages = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    return messages + [{"role": "user", "content": data["prompt"]}, {"role": "assistant", "content": response}]


def _checked(messages) -> list[dict]:
    if not isinstance(messages, list):
        raise RejectedSample("messages is not a list")
    if not messages:
        raise RejectedSample("empty conversation")
    checked = [_checked_message(m) for m in messages]
    if checked[0]["role"] == "assistant":
        raise RejectedSample("conversation starts with an assistant turn")
    if not any(m["role"] == "assistant" for m in checked):
        raise RejectedSample("no assistant turn")
    return checked


def _checked_message(message) -> dict:
    if not isinstance(message, dict):
        raise RejectedSample("message is not an object")
    if "role" not in message:
        raise RejectedSample("message has no role")
    role = message["role"]
    if role not in ROLES:
        raise RejectedSample(f"unknown role {role!r}")
    content = message.get("content")
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls is not None and not (isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls)):
        raise RejectedSample("tool_calls is not a list of objects")
    if calls and content is None:
        content = ""  # a turn that only calls tools
    if not isinstance(content, str):
        raise RejectedSample("content is not a string")
    if not calls and not content.strip():
        raise RejectedSample("empty content")
    checked = {"role": role, "content": content}
    if role == "assistant":
        reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RejectedSample("reasoning_content is not a string")
            checked["reasoning_content"] = reasoning
        if calls:
            checked["tool_calls"] = calls
    return checked


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, str):  # LLaMA-Factory stores the tool list as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError:
            raise RejectedSample("tools is not valid JSON") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RejectedSample("tools is not a list of objects")
    return tools or None


def _pretokenized(data: dict) -> Pretokenized:
    if "loss_mask" not in data:
        raise RejectedSample("input_ids without loss_mask")
    ids, mask = data["input_ids"], data["loss_mask"]
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise RejectedSample("input_ids is not a list of integers")
    if not isinstance(mask, list) or not all(type(v) is int and v in (0, 1) for v in mask):
        raise RejectedSample("loss_mask is not a list of 0/1 values")
    if len(ids) != len(mask):
        raise RejectedSample("input_ids and loss_mask lengths differ")
    if not ids:
        raise RejectedSample("empty input_ids")
    if min(ids) < 0 or max(ids) > np.iinfo(np.int32).max:
        raise RejectedSample("token id out of range")
    return Pretokenized(np.array(ids, dtype=np.int32), np.array(mask, dtype=np.uint8))
