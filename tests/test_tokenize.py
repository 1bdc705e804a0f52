"""Tokenization and assistant loss masks against the real Qwen3 tokenizer and chat template, and a Llama-3-style
template: the masked tokens must decode to exactly each assistant turn plus its end-of-turn token."""

from __future__ import annotations

import numpy as np
import pytest

from dflashq.exceptions import InputError
from producers.loss_mask import end_of_turn_marker
from producers.tokenize import (
    DROPPED_TOO_FEW_SUPERVISED,
    DROPPED_TOO_LONG,
    load_tokenizer,
    tokenize_record,
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    return load_tokenizer(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def llama3_dir(qwen3_tokenizer_dir, tmp_path_factory) -> str:
    """A copy of the Qwen3 tokenizer with Llama 3's header and end-of-turn special tokens and chat template."""
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    tokenizer.add_tokens(LLAMA3_TOKENS, special_tokens=True)
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.chat_template = LLAMA3_TEMPLATE
    folder = str(tmp_path_factory.mktemp("llama3-tokenizer"))
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama3(llama3_dir):
    return load_tokenizer(llama3_dir)


def masked_runs(tokenizer, result) -> list[str]:
    """Each contiguous run of supervised tokens, decoded."""
    mask = np.concatenate([[0], result.loss_mask, [0]]).astype(int)
    edges = np.flatnonzero(np.diff(mask))
    return [tokenizer.decode(result.input_ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


def kept(tokenizer, data, **kwargs):
    result = tokenize_record(tokenizer, data, **kwargs)
    assert result.kept, result.rejected or result.dropped
    assert result.input_ids.dtype == np.int32 and result.loss_mask.dtype == np.uint8
    assert result.input_ids.shape == result.loss_mask.shape
    return result


def test_qwen3_masks_each_assistant_turn_and_rendered_think_blocks(qwen3):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nadd again\n</think>\n\nIt is 6."},
        {"role": "user", "content": "Now call the calculator."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "use the tool",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "9*9"}}}],
        },
        {"role": "tool", "content": "81"},
        {"role": "assistant", "content": "9*9 is 81.", "reasoning_content": "the tool said 81"},
    ]
    result = kept(qwen3, {"messages": messages})
    # Think blocks before the last user query are dropped by the template, so neither rendered nor supervised.
    assert masked_runs(qwen3, result) == [
        "It is 4.<|im_end|>",
        "It is 6.<|im_end|>",
        '<think>\nuse the tool\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"expr": "9*9"}}\n</tool_call>'
        "<|im_end|>",
        "<think>\nthe tool said 81\n</think>\n\n9*9 is 81.<|im_end|>",
    ]
    assert "add them" not in qwen3.decode(result.input_ids)
    # The ids are exactly what Transformers' own chat templating produces.
    assert result.input_ids.tolist() == list(qwen3.apply_chat_template(messages, return_dict=False))


def test_qwen3_last_turn_keeps_inline_think_and_empty_think_is_supervised(qwen3):
    inline = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\ngreet back\n</think>\n\nHello!"},
    ]
    assert masked_runs(qwen3, kept(qwen3, {"messages": inline})) == [
        "<think>\ngreet back\n</think>\n\nHello!<|im_end|>"
    ]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert masked_runs(qwen3, kept(qwen3, {"messages": plain})) == ["<think>\n\n</think>\n\nHello!<|im_end|>"]


def test_qwen3_role_headers_user_text_and_glue_newlines_are_not_supervised(qwen3):
    result = kept(qwen3, {"prompt": "Say yes.", "response": "Yes."})
    text_of = {int(i): qwen3.decode([int(i)]) for i in result.input_ids}
    unsupervised = "".join(text_of[int(i)] for i in result.input_ids[result.loss_mask == 0])
    assert unsupervised == "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n\n"
    assert end_of_turn_marker(qwen3) == "<|im_end|>"


def test_llama3_style_template(llama3):
    assert end_of_turn_marker(llama3) == "<|eot_id|>"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "<think>\nnot blue\n</think>\nRed."},
    ]
    result = kept(llama3, {"messages": messages})
    assert masked_runs(llama3, result) == ["Blue.<|eot_id|>", "<think>\nnot blue\n</think>\nRed.<|eot_id|>"]
    bos = llama3.convert_tokens_to_ids("<|begin_of_text|>")
    assert result.input_ids[0] == bos and (result.input_ids == bos).sum() == 1  # the template's BOS, no second one


def test_sharegpt_with_system_and_function_calls(qwen3):
    data = {
        "system": "You may use tools.",
        "tools": '[{"name": "weather", "parameters": {}}]',
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
            {"from": "observation", "value": "rain"},
            {"from": "gpt", "value": "It rains."},
        ],
    }
    result = kept(qwen3, data)
    text = qwen3.decode(result.input_ids)
    assert text.startswith("<|im_start|>system\nYou may use tools.\n\n# Tools")
    assert "<tool_response>\nrain\n</tool_response>" in text
    assert masked_runs(qwen3, result) == [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt rains.<|im_end|>",
    ]


def test_prompt_completion_pair(qwen3):
    result = kept(qwen3, {"system": "S", "prompt": "P", "completion": "C"})
    assert qwen3.decode(result.input_ids).startswith("<|im_start|>system\nS<|im_end|>")
    assert masked_runs(qwen3, result) == ["<think>\n\n</think>\n\nC<|im_end|>"]


def test_pretokenized_skips_the_template(qwen3):
    result = kept(qwen3, {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 0]})
    assert result.input_ids.tolist() == [1, 2, 3, 4] and result.loss_mask.tolist() == [0, 1, 1, 0]


def test_tokenizer_without_chat_template(qwen3_tokenizer_dir):
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    tokenizer.chat_template = None
    with pytest.raises(InputError, match="has no chat template"):
        tokenize_record(tokenizer, {"prompt": "P", "response": "R"})
    assert tokenize_record(tokenizer, {"input_ids": [5, 6], "loss_mask": [1, 1]}).kept


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(InputError, match="no-such-model"):
        load_tokenizer(str(tmp_path / "no-such-model"))
    with pytest.raises(InputError, match="no loadable tokenizer"):
        load_tokenizer(str(tmp_path))


CALL = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
REJECTIONS = [
    ({"text": "hello"}, "no messages, conversations, prompt or input_ids field"),
    ({"messages": "hi"}, "messages is not a list"),
    ({"messages": []}, "empty conversation"),
    ({"messages": ["hi"]}, "message is not an object"),
    ({"messages": [{"content": "hi"}]}, "message has no role"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}, "content is not a string"),
    ({"messages": [{"role": "user", "content": " \n"}, {"role": "assistant", "content": "a"}]}, "empty content"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, "content is not a string"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
     "conversation starts with an assistant turn"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 1}]},
     "reasoning_content is not a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": "f()"}]},
     "tool_calls is not a list of objects"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": CALL}],
      "tools": "{not json"}, "tools is not valid JSON"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": {"f": 1}},
     "tools is not a list of objects"),
    ({"conversations": {"from": "human"}}, "conversations is not a list"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role 'alien'"),
    ({"conversations": [{"value": "x"}]}, "message has no role"),
    ({"prompt": "p"}, "prompt without response or completion"),
    ({"prompt": "p", "response": ""}, "empty content"),
    ({"input_ids": [1, 2]}, "input_ids without loss_mask"),
    ({"input_ids": [1, "2"], "loss_mask": [1, 1]}, "input_ids is not a list of integers"),
    ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "loss_mask is not a list of 0/1 values"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "input_ids and loss_mask lengths differ"),
    ({"input_ids": [], "loss_mask": []}, "empty input_ids"),
    ({"input_ids": [1, -2], "loss_mask": [1, 1]}, "token id out of range"),
    ({"input_ids": [1, 10**7], "loss_mask": [1, 1]}, "token id out of range"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a<|im_end|>b"}]},
     "assistant content contains the end-of-turn marker"),
    ({"messages": [{"role": "user", "content": "q\ud800"}, {"role": "assistant", "content": "a"}]},
     "text is not valid Unicode"),
    # Qwen3 renders an empty think block on a final assistant turn but not on the same turn followed by another
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "assistant", "content": "b"}]}, "chat template renders turns inconsistently"),
]


@pytest.mark.parametrize("data,reason", REJECTIONS, ids=[reason for _, reason in REJECTIONS])
def test_rejections(qwen3, data, reason):
    result = tokenize_record(qwen3, data)
    assert not result.kept and result.rejected == reason and result.dropped is None


def test_template_errors_and_missing_end_of_turn_are_rejections(llama3_dir):
    tokenizer = load_tokenizer(llama3_dir)
    # Like real templates: raise on a role it does not support, and leave an unfinished turn open.
    tokenizer.chat_template = LLAMA3_TEMPLATE.replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}"
        "{% if message.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}",
    ).replace("'<|eot_id|>'", "('' if message['content'].endswith('...') else '<|eot_id|>')")
    user = {"role": "user", "content": "q"}
    with_tool = [user, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    assert tokenize_record(tokenizer, {"messages": with_tool}).rejected == "chat template error: no tool role"
    unfinished = [user, {"role": "assistant", "content": "to be continued..."}]
    assert tokenize_record(tokenizer, {"messages": unfinished}).rejected == "assistant turn has no end-of-turn marker"


def test_truncation_and_drops(qwen3):
    data = {"prompt": "Count.", "response": " ".join(["one two three"] * 20)}
    full = kept(qwen3, data, max_length=4096)
    assert not full.truncated
    cut = kept(qwen3, data, max_length=30)
    assert cut.truncated and len(cut.input_ids) == 30
    assert cut.input_ids.tolist() == full.input_ids[:30].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:30].tolist()

    dropped = tokenize_record(qwen3, data, max_length=30, on_long="drop")
    assert not dropped.kept and dropped.dropped == DROPPED_TOO_LONG and dropped.rejected is None

    prompt_only = tokenize_record(qwen3, data, max_length=10)  # truncation leaves only the user turn
    assert not prompt_only.kept and prompt_only.truncated and prompt_only.dropped == DROPPED_TOO_FEW_SUPERVISED

    few = {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}
    assert tokenize_record(qwen3, few, min_supervised=2).dropped == DROPPED_TOO_FEW_SUPERVISED
    assert tokenize_record(qwen3, few, min_supervised=1).kept
