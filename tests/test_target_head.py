"""TargetHead reads only embed_tokens and lm_head from real save_pretrained checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflashq.exceptions import InputError
from trainer.target_head import TargetHead


def save_tiny_qwen3(path, tied: bool, max_shard_size: str | None = None) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_loads_the_two_tensors_of_a_single_file_checkpoint(tmp_path, tied):
    model = save_tiny_qwen3(tmp_path, tied)
    head = TargetHead.from_pretrained(tmp_path)
    torch.testing.assert_close(head.embed_tokens, model.model.embed_tokens.weight.detach())
    torch.testing.assert_close(head.lm_head, model.lm_head.weight.detach())
    assert tied == torch.equal(head.lm_head, head.embed_tokens)
    assert head.state_dict() == {}  # frozen buffers, never saved with a drafter


def test_sharded_checkpoint_reads_only_the_shards_holding_the_head(tmp_path):
    model = save_tiny_qwen3(tmp_path, tied=False, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map["model.embed_tokens.weight"], weight_map["lm_head.weight"]}
    others = set(weight_map.values()) - needed
    assert others  # the index really spreads the model over more shards
    for name in others:  # a shard the head does not need may be absent
        (tmp_path / name).unlink()
    head = TargetHead.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert head.embed_tokens.dtype == torch.bfloat16
    torch.testing.assert_close(head.lm_head, model.lm_head.weight.detach().bfloat16())


def test_multimodal_key_prefix_and_tied_fallback(tmp_path):
    embed = torch.randn(10, 4)
    save_file({"model.language_model.embed_tokens.weight": embed, "model.visual.patch.weight": torch.ones(2)},
              tmp_path / "model.safetensors")
    head = TargetHead.from_pretrained(tmp_path)
    assert torch.equal(head.embed_tokens, embed) and torch.equal(head.lm_head, embed)
    assert torch.equal(head.embed(torch.tensor([3])), embed[3:4])


def test_a_folder_without_weights_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="safetensors"):
        TargetHead.from_pretrained(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        TargetHead.from_pretrained(tmp_path / "missing")
