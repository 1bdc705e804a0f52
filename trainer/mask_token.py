"""The MASK token of the drafter's blocks: an existing row of the target's (frozen) embedding that real text never
puts in front of the drafter.

The rule, in order (the first that applies wins):
1. `train.mask_token_id` when set (>= 0);
2. the tokenizer's own mask token;
3. the first embedding row past the tokenizer's vocabulary (Qwen3: 151669, Qwen3.5/3.6: 248070): a reserved row
   that exists but is never a token, as the released drafters use;
4. the special added token with the HIGHEST id that the chat template never renders: not the bos/eos/pad/unk
   token, not named in the template's source and not in a rendered sample chat (SmolLM2, whose 49152 rows are
   all tokens: `<empty_output>`, 16). Highest, because tokenizers put their least used specials (reserved,
   tool or notebook markers) last.
"""

from __future__ import annotations

import dataclasses

from dflashq.exceptions import ConfigError

SAMPLE_CHAT = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]


@dataclasses.dataclass(frozen=True)
class MaskToken:
    id: int
    reason: str  # which rule chose it, for the one line the trainer prints


def resolve_mask_token(model_path: str, configured: int, vocab_size: int) -> MaskToken:
    """The MASK token for a target with a `vocab_size`-row embedding, by the module's rule."""
    if configured >= 0:
        return MaskToken(configured, "train.mask_token_id")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.mask_token_id is not None:
        return MaskToken(int(tokenizer.mask_token_id), f"the tokenizer's mask token {tokenizer.mask_token!r}")
    if len(tokenizer) < vocab_size:
        return MaskToken(len(tokenizer), "the first embedding row past the tokenizer's vocabulary")
    unused = unrendered_special_tokens(tokenizer)
    if unused:
        token_id = max(unused)
        return MaskToken(token_id, f"the highest-id special token the chat template never renders, {unused[token_id]!r}")
    raise ConfigError(
        f"The target's tokenizer has no mask token, no spare embedding row (vocabulary {vocab_size}) and no special "
        "token its chat template leaves unused: set train.mask_token_id to a reserved token id."
    )


def unrendered_special_tokens(tokenizer) -> dict[int, str]:
    """Special added tokens (id -> text) that neither the chat template nor the bos/eos/pad/unk roles use."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template or "")
    rendered: set[int] = set()
    if tokenizer.chat_template:
        rendered = set(tokenizer.apply_chat_template(SAMPLE_CHAT, tokenize=True, return_dict=True)["input_ids"])
    roles = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    return {
        token_id: added.content
        for token_id, added in tokenizer.added_tokens_decoder.items()
        if added.special and token_id not in roles and token_id not in rendered and added.content not in template
    }
