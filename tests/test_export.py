"""Export to the z-lab DFlash format and back, for a drafter built for a tiny Qwen3.5-style hybrid target."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from dflashq.exceptions import InputError
from trainer.checkpoint import TrainState, rng_state, save
from trainer.parallel import full_state
from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.export import export_checkpoint, export_drafter, load_exported
from trainer.target_head import TargetHead

MASK_ID = 151669
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def drafter(tiny_qwen35) -> DFlashDrafter:
    with open(f"{tiny_qwen35}/config.json") as f:
        target = json.load(f)
    config = DrafterConfig.default_for_target(target, num_layers=NUM_LAYERS, mask_token_id=MASK_ID, block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():  # norms away from 1, so a swapped or dropped norm shows in the outputs
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return drafter.eval()


def expected_shapes(h: int, k: int, q: int, kv: int, d: int, inter: int) -> dict[str, tuple[int, ...]]:
    """The export's tensor list (docs/architecture.md), spelled out independently of the drafter's module names."""
    shapes = {"fc.weight": (h, k * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(NUM_LAYERS):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q * d, h),
            p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h),
            p + "self_attn.o_proj.weight": (h, q * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return shapes


def test_export_writes_the_zlab_format(drafter, tmp_path):
    out = export_drafter(drafter, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".tmp-*"))
    config = json.loads((out / "config.json").read_text())
    assert config == {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e7,
        "max_position_embeddings": 4096,
        "vocab_size": 151936,
        "attention_bias": False,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "use_sliding_window": False,
        "block_size": 8,
        "num_target_layers": 8,
        "dflash_config": {"target_layer_ids": [1, 5], "mask_token_id": MASK_ID, "block_size": 8},
        "torch_dtype": "bfloat16",
    }
    with safe_open(out / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        assert "z-lab" in f.metadata()["target_layer_ids_convention"]
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected_shapes(64, 2, 4, 2, 16, 128)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert not any("embed" in n or "lm_head" in n for n in tensors)
    source = drafter.state_dict()
    assert all(torch.equal(t, source[n].to(torch.bfloat16)) for n, t in tensors.items())


def test_export_follows_a_sliding_layout(drafter, tmp_path):
    sliding = DFlashDrafter(dataclasses.replace(drafter.config, layer_types=["sliding_attention", "full_attention"],
                                                sliding_window=16))
    out = export_drafter(sliding, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["use_sliding_window"] is True and config["sliding_window"] == 16
    assert load_exported(out).config == sliding.config


def test_load_exported_reproduces_the_drafter_in_bf16(drafter, tiny_qwen35, tmp_path):
    loaded = load_exported(export_drafter(drafter, tmp_path / "export"))
    assert loaded.config == drafter.config
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    head = TargetHead.from_pretrained(tiny_qwen35)
    reference = DFlashDrafter(drafter.config)
    reference.load_state_dict(drafter.state_dict())
    reference = reference.to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(3)
    context = torch.randn(2, 30, 2 * 64, generator=gen)  # [b, C, K*H]
    last = torch.tensor([11, 2222])
    start = torch.tensor([30, 17])
    expected = reference.draft(context, last, start, head, attention="sdpa")
    assert torch.equal(loaded.draft(context, last, start, head, attention="sdpa"), expected)
    # and the export really differs from an untrained drafter of the same config
    assert not torch.equal(DFlashDrafter(drafter.config).to(torch.bfloat16).draft(context, last, start, head), expected)


def test_export_checkpoint_exports_the_checkpointed_weights(drafter, tmp_path):
    optimizer = torch.optim.AdamW(drafter.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    weights, optimizer_state = full_state(drafter, optimizer)  # as the trainer saves: full tensors, one rank
    checkpoint = save(tmp_path / "checkpoints", drafter.config, weights, optimizer_state, scheduler.state_dict(),
                      TrainState(step=7), [rng_state(torch.device("cpu"))])
    out = export_checkpoint(checkpoint, tmp_path / "export")
    loaded = load_exported(out)
    assert all(torch.equal(p, drafter.state_dict()[n].to(torch.bfloat16)) for n, p in loaded.state_dict().items())


def test_bad_paths_raise_input_errors(drafter, tmp_path):
    with pytest.raises(InputError, match="not an exported drafter"):
        load_exported(tmp_path / "missing")
    with pytest.raises(InputError, match="not a trainer checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "export")
    out = export_drafter(drafter, tmp_path / "export")
    with pytest.raises(InputError, match="already exists"):
        export_drafter(drafter, out)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(InputError, match="not a valid DFlash drafter config"):
        load_exported(out)


def test_dflash2_export_names_its_architecture_and_reads_back(drafter, tmp_path):
    config = dataclasses.replace(drafter.config, architecture="dflash2", selector_rank=8, selector_top_k=4)
    torch.manual_seed(1)
    dflash2 = DFlashDrafter(config)
    with torch.no_grad():
        for name, param in dflash2.named_parameters():
            if "_conv." in name or "codebook" in name:
                param.normal_()
    out = export_drafter(dflash2, tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert written["dflash_config"] == {"target_layer_ids": [1, 5], "mask_token_id": MASK_ID, "block_size": 8,
                                        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                        "selector_top_k": 4}
    with safe_open(out / "model.safetensors", framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    added = {name: shape for name, shape in shapes.items() if name not in expected_shapes(64, 2, 4, 2, 16, 128)}
    assert added == {**{f"layers.{i}.{conv}.{name}": shape for i in range(NUM_LAYERS)
                        for conv in ("attention_conv", "mlp_conv")
                        for name, shape in (("base_kernel", (2, 2, 64)), ("kernel_projection.weight", (16, 64)))},
                     # bare codebook tensors: the reference's from_pretrained adds `.weight` to these two names
                     "candidate_selector.predecessor_codebook": (151936, 8),
                     "candidate_selector.successor_codebook": (151936, 8),
                     "candidate_selector.hidden_projection.weight": (8, 64)}
    loaded = load_exported(out)
    assert loaded.config == config
    assert all(torch.equal(p, dflash2.state_dict()[n].to(torch.bfloat16)) for n, p in loaded.state_dict().items())
