"""The MASK token of the drafter's blocks: an existing row of the target's (frozen) embedding."""

from __future__ import annotations

from dflashq.exceptions import ConfigError


def resolve_mask_token_id(model_path: str, configured: int, vocab_size: int) -> int:
    """`configured` if set (>= 0); else the tokenizer's mask token; else the first embedding row past the
    tokenizer's vocabulary (Qwen3: 151669, Qwen3.5/3.6: 248070), a reserved row that exists but is never a token."""
    if configured >= 0:
        return configured
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    raise ConfigError(
        f"The target's tokenizer has no mask token and no spare embedding row (vocabulary {vocab_size}): set "
        "train.mask_token_id to a reserved token id."
    )
