"""Turning one dataset record into a training sample: token ids and the assistant loss mask, truncated or dropped
by length, dropped when too little of it is supervised. Pure functions; the producer counts the outcomes."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from transformers import AutoTokenizer

from dflashq import defaults
from dflashq.exceptions import InputError, RejectedSample
from producers.conversation import Pretokenized, normalize
from producers.loss_mask import render_and_mask

DROPPED_TOO_LONG = "too long"
DROPPED_TOO_FEW_SUPERVISED = "too few supervised tokens"


@dataclasses.dataclass(frozen=True)
class TokenizeResult:
    input_ids: np.ndarray | None = None  # [T] int32, set when the sample is kept
    loss_mask: np.ndarray | None = None  # [T] uint8
    rejected: str | None = None  # the record is unusable: RejectedSample's reason
    dropped: str | None = None  # a valid record left out: DROPPED_TOO_LONG or DROPPED_TOO_FEW_SUPERVISED
    truncated: bool = False  # cut to max_length (and then kept, or dropped for too few supervised tokens)

    @property
    def kept(self) -> bool:
        return self.input_ids is not None


def load_tokenizer(model_path: str, trust_remote_code: bool = defaults.TRUST_REMOTE_CODE):
    """The target's fast tokenizer (with its chat template) from a local model folder."""
    if not os.path.isdir(model_path):
        raise InputError(f"Model folder {model_path} does not exist; set model.path to a local model folder.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise InputError(f"Model folder {model_path} holds no loadable tokenizer ({exc}).") from None
    if not tokenizer.is_fast:
        raise InputError(f"Model folder {model_path} needs a fast tokenizer (tokenizer.json).")
    return tokenizer


def tokenize_record(
    tokenizer,
    data: dict,
    max_length: int = defaults.MAX_LENGTH,
    on_long: str = defaults.ON_LONG,
    min_supervised: int = defaults.MIN_SUPERVISED_TOKENS,
) -> TokenizeResult:
    """One record as a kept, rejected or dropped sample (never raises RejectedSample)."""
    try:
        sample = normalize(data)
        if isinstance(sample, Pretokenized):
            if int(sample.input_ids.max()) >= len(tokenizer):
                raise RejectedSample("token id out of range")
            input_ids, loss_mask = sample.input_ids, sample.loss_mask
        else:
            input_ids, loss_mask = render_and_mask(tokenizer, sample)
    except RejectedSample as exc:
        return TokenizeResult(rejected=exc.reason)
    truncated = len(input_ids) > max_length
    if truncated:
        if on_long == "drop":
            return TokenizeResult(dropped=DROPPED_TOO_LONG)
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    if int(loss_mask.sum()) < min_supervised:
        return TokenizeResult(dropped=DROPPED_TOO_FEW_SUPERVISED, truncated=truncated)
    return TokenizeResult(input_ids, loss_mask, truncated=truncated)
