"""The batched drafter forward (SDPA and flex paths) against a slow per-block, per-slot reference of the rule."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dflashq import defaults
from dflashq.exceptions import ConfigError
from torch.nn.attention.flex_attention import create_block_mask

from trainer.anchors import gather_blocks, sample_anchors
from trainer.attention_mask import dflash_mask_mod, flex_block_mask
from trainer.drafter import DFlashDrafter, DrafterConfig, _layer_sizes
from trainer.target_head import TargetHead

HIDDEN, VOCAB, MASK, BLOCK, WINDOW = 64, 97, 96, 4, 6
LENGTHS = (21, 14, 9)
SLIDING, FULL = "sliding_attention", "full_attention"

# Eager flex_attention on CPU warns that it is unfused; that is expected in these tests.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def make_drafter(layer_types: list[str], architecture: str = "dflash") -> DFlashDrafter:
    target = {"hidden_size": HIDDEN, "num_hidden_layers": 8, "vocab_size": VOCAB, "intermediate_size": 96,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}
    config = DrafterConfig.default_for_target(
        target, num_layers=len(layer_types), layer_ids=[1, 5], mask_token_id=MASK, block_size=BLOCK,
        sliding_window=WINDOW, layer_types=layer_types, architecture=architecture, selector_rank=8, selector_top_k=5,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    with torch.no_grad():  # non-trivial norm weights, so a norm applied to the wrong tensor shows
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "_conv." in name or "codebook" in name:  # DFlash2's parts away from their identity init
                param.normal_(0.0, 0.3)
    return drafter


@pytest.fixture(scope="module")
def head() -> TargetHead:
    gen = torch.Generator().manual_seed(1)
    return TargetHead(torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen))


def micro_batch(lengths, seed: int):
    """Right-padded sequences of these lengths; garbage context states beyond each length."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    input_ids = torch.randint(0, MASK, (len(lengths), seq_len), generator=gen)
    loss_mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, length in enumerate(lengths):
        loss_mask[row, 3:length] = 1
    loss_mask[0, 10] = 0  # a hole: positions 9 and 10 are no anchors
    context = torch.randn(len(lengths), seq_len, 2 * HIDDEN, generator=gen)
    anchors, valid = sample_anchors(loss_mask, 7, gen)
    block_ids, _, _ = gather_blocks(input_ids, loss_mask, anchors, valid, BLOCK, MASK)
    return context, block_ids, anchors, valid


@pytest.fixture(scope="module")
def batch():
    """Three sequences of different lengths."""
    return micro_batch(LENGTHS, 2)


# ---- the slow reference: one query slot at a time, keys chosen by reading the rule literally ----

def rms(x, weight, eps):
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """Rotation of the pairs (i, i + D/2) as complex numbers: an independent spelling of half-split RoPE."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angle = positions.double()[:, None] * freqs
    rotated = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([rotated.real, rotated.imag], -1).float()


def reference_block(drafter, head, context_states, token_ids, anchor):
    """Hidden states [B, H] of one block at `anchor`, looping over layers and query slots."""
    cfg = drafter.config
    eps, theta, d = cfg.rms_norm_eps, cfg.rope_theta, cfg.head_dim
    ctx = rms(context_states @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)  # [T, H]
    x = head.embed_tokens[token_ids]  # [B, H]
    block_pos = anchor + torch.arange(BLOCK)
    for layer, layer_type in zip(drafter.layers, cfg.layer_types):
        att = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, eps)

        def keys_values(inp, positions):
            k = rms((inp @ att.k_proj.weight.T).view(len(inp), -1, d), att.k_norm.weight, eps)
            v = (inp @ att.v_proj.weight.T).view(len(inp), -1, d)
            return rope(k.transpose(0, 1), positions, theta), v.transpose(0, 1)  # [hkv, s, D]

        q = rope(rms((h @ att.q_proj.weight.T).view(BLOCK, -1, d), att.q_norm.weight, eps).transpose(0, 1),
                 block_pos, theta)  # [hq, B, D]
        k_blk, v_blk = keys_values(h, block_pos)
        rows = []
        for k in range(BLOCK):
            q_pos = anchor + k
            ctx_pos = [c for c in range(anchor) if layer_type == FULL or q_pos - c < cfg.sliding_window]
            own = [j for j in range(BLOCK) if layer_type == FULL or (j <= k and k - j < cfg.sliding_window)]
            k_ctx, v_ctx = keys_values(ctx[ctx_pos], torch.tensor(ctx_pos, dtype=torch.long))
            keys = torch.cat([k_ctx, k_blk[:, own]], 1)  # [hkv, n, D]
            values = torch.cat([v_ctx, v_blk[:, own]], 1)
            group = att.num_heads // att.num_kv_heads
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [hq, n, D]
            scores = (keys @ q[:, k, :, None])[..., 0] / d**0.5  # [hq, n]
            rows.append((scores.softmax(-1)[:, None, :] @ values)[:, 0].reshape(-1))  # [hq*D]
        x = x + torch.stack(rows) @ att.o_proj.weight.T
        h = rms(x, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        x = x + (F.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(x, drafter.norm.weight, eps)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("layer_types", [[SLIDING, SLIDING], [FULL, FULL], [SLIDING, FULL]])
def test_batched_forward_matches_per_block_reference(attention, layer_types, head, batch):
    drafter = make_drafter(layer_types)
    context, block_ids, anchors, valid = batch
    with torch.no_grad():
        hidden = drafter(context, block_ids, anchors, head, attention=attention)  # [b, N, B, H]
        for row, col in valid.nonzero().tolist():
            expected = reference_block(drafter, head, context[row], block_ids[row, col], int(anchors[row, col]))
            torch.testing.assert_close(hidden[row, col], expected, atol=2e-5, rtol=1e-4)
    assert valid.sum() > 10 and not valid.all()  # several blocks per row, and padded blocks present


@pytest.mark.slow
@pytest.mark.parametrize("group_blocks", [1, 2, 3])
def test_sdpa_groups_of_blocks_match_the_reference_and_each_other(group_blocks, head, batch, monkeypatch):
    """SDPA attends groups of consecutive blocks, each over the context up to its largest anchor and its own block
    keys; any grouping gives the reference's states and the gradients of one group holding every block."""
    drafter = make_drafter([SLIDING, FULL])
    context, block_ids, anchors, valid = batch
    assert anchors.shape[1] > 2 * group_blocks  # several groups, the last one shorter for 2 and 3
    monkeypatch.setattr(defaults, "SDPA_GROUP_BLOCKS", anchors.shape[1])
    whole = drafter(context, block_ids, anchors, head, attention="sdpa")  # [b, N, B, H]
    whole[valid].square().sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    drafter.zero_grad()
    monkeypatch.setattr(defaults, "SDPA_GROUP_BLOCKS", group_blocks)
    grouped = drafter(context, block_ids, anchors, head, attention="sdpa")
    grouped[valid].square().sum().backward()
    torch.testing.assert_close(grouped[valid], whole[valid], atol=2e-5, rtol=1e-4)
    for name, param in drafter.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], atol=1e-4, rtol=1e-4, msg=name)
    with torch.no_grad():
        for row, col in valid.nonzero().tolist():
            expected = reference_block(drafter, head, context[row], block_ids[row, col], int(anchors[row, col]))
            torch.testing.assert_close(grouped[row, col], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layer_types", [[SLIDING, FULL], [FULL]])
def test_context_is_seen_strictly_before_the_anchor(layer_types, head, batch):
    drafter = make_drafter(layer_types)
    context, block_ids, anchors, _ = batch
    row, col = 0, 2
    anchor = int(anchors[row, col])
    with torch.no_grad():
        base = drafter(context, block_ids, anchors, head)[row, col]
        for position, changes in ((anchor, False), (anchor - 1, True)):
            edited = context.clone()
            edited[row, position] += 1.0
            out = drafter(edited, block_ids, anchors, head)[row, col]
            assert (not torch.allclose(out, base, atol=1e-6)) == changes, f"context at {position}, anchor {anchor}"


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])  # DFlash2's convolutions stay inside each block
def test_blocks_are_blind_to_each_other(architecture, head, batch):
    drafter = make_drafter([SLIDING, FULL], architecture)
    context, block_ids, anchors, _ = batch
    edited_ids, edited_anchors = block_ids.clone(), anchors.clone()
    edited_ids[0, 1, 0] = (edited_ids[0, 1, 0] + 1) % MASK
    edited_anchors[0, 1] += 1
    with torch.no_grad():
        base = drafter(context, block_ids, anchors, head)
        out = drafter(context, edited_ids, edited_anchors, head)
    changed = (out - base).abs().amax(-1).amax(-1) > 1e-6  # [b, N]
    assert changed[0, 1] and changed.sum() == 1


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_draft_equals_training_forward_of_one_block(architecture, head, batch):
    drafter = make_drafter([SLIDING, FULL], architecture)
    context, _, _, _ = batch
    anchor, token = 11, 5
    block_ids = torch.tensor([[[token] + [MASK] * (BLOCK - 1)]])
    with torch.no_grad():
        hidden = drafter(context[:1], block_ids, torch.tensor([[anchor]]), head)  # [1, 1, B, H]
    expected = head.logits(hidden[0, 0, 1:])  # [B-1, V]
    exact_context = drafter.draft(context[:1, :anchor], torch.tensor([token]), anchor, head)
    longer_context = drafter.draft(context[:1], torch.tensor([token]), torch.tensor([anchor]), head)
    torch.testing.assert_close(exact_context[0], expected)
    torch.testing.assert_close(longer_context[0], expected)  # positions >= start_pos are not seen


def test_module_names_are_the_export_tensor_names():
    drafter = make_drafter([SLIDING, FULL])
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}.weight" for i in range(2) for name in per_layer}
    assert set(drafter.state_dict()) == expected
    assert drafter.fc.weight.shape == (HIDDEN, 2 * HIDDEN)
    # DFlash2: the reference's names and shapes (groups of 16 channels, 2 taps, selector rank 8)
    dflash2 = make_drafter([SLIDING, FULL], "dflash2").state_dict()
    added = {f"layers.{i}.{conv}.{name}": shape for i in range(2) for conv in ("attention_conv", "mlp_conv")
             for name, shape in (("base_kernel", (2, 2, HIDDEN)), ("kernel_projection.weight", (2 * 2 * 4, HIDDEN)))}
    added |= {"candidate_selector.predecessor_codebook.weight": (VOCAB, 8),
              "candidate_selector.successor_codebook.weight": (VOCAB, 8),
              "candidate_selector.hidden_projection.weight": (8, HIDDEN)}
    assert {name: tuple(t.shape) for name, t in dflash2.items() if name not in expected} == added
    assert expected <= set(dflash2)


def test_a_fresh_dflash2_drafter_drafts_what_dflash_does(head, batch):
    """DFlash2's parts start as the identity (convolutions) and as each slot's argmax (selector): training starts
    from the DFlash drafter of the same other weights, and its additions learn only what helps."""
    dflash = make_drafter([SLIDING, FULL])
    torch.manual_seed(5)
    fresh = DFlashDrafter(dataclasses.replace(dflash.config, architecture="dflash2", selector_top_k=VOCAB))
    assert fresh.load_state_dict(dflash.state_dict(), strict=False).unexpected_keys == []
    context, block_ids, anchors, _ = batch
    with torch.no_grad():
        torch.testing.assert_close(fresh(context, block_ids, anchors, head), dflash(context, block_ids, anchors, head),
                                   rtol=0, atol=0)
    last = torch.tensor([3, 50])
    drafts = fresh.propose(context[:2], last, torch.tensor([9, 12]), head)
    assert torch.equal(drafts, dflash.draft(context[:2], last, torch.tensor([9, 12]), head).argmax(-1))
    with torch.no_grad():  # and the selector is no argmax once its pair terms are not zero
        fresh.candidate_selector.successor_codebook.weight.normal_(0.0, 3.0)
    assert not torch.equal(fresh.propose(context[:2], last, torch.tensor([9, 12]), head), drafts)


def test_dflash2_sizes_are_checked():
    drafter = make_drafter([FULL])
    with pytest.raises(ConfigError, match="train.conv_group_size"):
        dataclasses.replace(drafter.config, architecture="dflash2", conv_group_size=24)
    with pytest.raises(ConfigError, match="train.selector_top_k"):
        dataclasses.replace(drafter.config, architecture="dflash2", selector_top_k=VOCAB + 1)
    with pytest.raises(ConfigError, match="train.architecture"):
        dataclasses.replace(drafter.config, architecture="dflash3")


# config.json fields of real targets (their published configs; only what the drafter defaults read)
TARGETS = {
    "Qwen3-8B": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936},
    "Qwen3.5-4B": {"text_config": {"hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16,
                                   "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216,
                                   "vocab_size": 248320}},
    "Qwen3.6-27B": {"text_config": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 24,
                                    "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408,
                                    "vocab_size": 248320, "partial_rotary_factor": 0.25}},
    "Llama-3-8B": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "intermediate_size": 14336, "vocab_size": 128256},
    "SmolLM2-135M": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "intermediate_size": 1536, "vocab_size": 49152},
}


@pytest.mark.parametrize("name, heads, layer_ids", [
    ("Qwen3-8B", (32, 8, 128), [1, 9, 17, 25, 33]),
    ("Qwen3.5-4B", (32, 8, 128), [1, 8, 15, 22, 29]),
    ("Qwen3.6-27B", (32, 8, 128), [1, 16, 31, 46, 61]),
    ("Llama-3-8B", (32, 8, 128), [1, 8, 15, 22, 29]),
    ("SmolLM2-135M", (9, 3, 64), [1, 8, 14, 20, 27]),  # under hidden 1024: the target's own attention shape
])
def test_default_drafter_shape_is_servable(name, heads, layer_ids):
    target = TARGETS[name]
    text = target.get("text_config") or target
    config = DrafterConfig.default_for_target(target, mask_token_id=0)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == heads
    assert config.target_layer_ids == layer_ids
    assert config.layer_types == [FULL] * 5  # what stock vLLM and SGLang run
    assert config.intermediate_size == text["intermediate_size"] and config.rope_theta == 1e7
    with torch.device("meta"):
        attention = DFlashDrafter(config).layers[0].self_attn
    assert attention.q_proj.weight.shape == (heads[0] * heads[2], text["hidden_size"])  # wider than H for Qwen3.5-4B
    assert attention.k_proj.weight.shape == (heads[1] * heads[2], text["hidden_size"])
    if text["hidden_size"] >= 1024:
        for tp in (1, 2, 4, 8):  # vLLM and SGLang shard query and kv heads across tensor-parallel ranks
            assert config.num_attention_heads % tp == 0 and config.num_key_value_heads % tp == 0


def test_released_27b_layout_and_size():
    config = DrafterConfig.default_for_target(TARGETS["Qwen3.6-27B"], mask_token_id=248070,
                                              layer_types=[SLIDING] * 4 + [FULL])
    assert config.layer_types == [SLIDING] * 4 + [FULL] and config.sliding_window == 2048
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashDrafter(config).parameters())
    assert 1.70e9 < params < 1.76e9


def test_every_shape_field_can_be_overridden():
    config = DrafterConfig.default_for_target(TARGETS["Qwen3-8B"], mask_token_id=0, num_attention_heads=16,
                                              num_key_value_heads=4, head_dim=64, intermediate_size=4096)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size) == \
        (16, 4, 64, 4096)


def test_mask_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="mask_token_id"):
        DrafterConfig.default_for_target({"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 10,
                                          "num_attention_heads": 4}, num_layers=1, mask_token_id=10)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_flex_equals_sdpa_when_the_blocks_do_not_fill_the_last_kernel_tile(device):
    """N*B = 37*16 = 592 query rows, not a multiple of the compiled kernel's 128-row tile (CUDA: compiled flex)."""
    target = {"hidden_size": HIDDEN, "num_hidden_layers": 8, "vocab_size": VOCAB, "intermediate_size": 96,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}
    config = DrafterConfig.default_for_target(target, num_layers=2, layer_ids=[1, 5], mask_token_id=MASK,
                                              block_size=16, sliding_window=40, layer_types=[SLIDING, FULL])
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(device)
    gen = torch.Generator().manual_seed(3)
    head = TargetHead(torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)).to(device)
    seq_len, num_blocks = 300, 37
    input_ids = torch.randint(0, MASK, (2, seq_len), generator=gen)
    loss_mask = torch.ones(2, seq_len, dtype=torch.long)
    loss_mask[1, 200:] = 0
    anchors, valid = sample_anchors(loss_mask, num_blocks, gen)
    block_ids, _, _ = gather_blocks(input_ids, loss_mask, anchors, valid, 16, MASK)
    context = torch.randn(2, seq_len, 2 * HIDDEN, generator=gen)
    inputs = [t.to(device) for t in (context, block_ids, anchors)]
    assert anchors.shape == (2, num_blocks) and (num_blocks * 16) % 128
    with torch.no_grad():
        flex = drafter(*inputs, head, attention="flex")  # [b, N, B, H]
        sdpa = drafter(*inputs, head, attention="sdpa")
    torch.testing.assert_close(flex[valid.to(device)], sdpa[valid.to(device)], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size, seq_len, num_blocks", [(16, 300, 37), (16, 512, 64), (12, 700, 50), (4, 150, 9)])
@pytest.mark.parametrize("window", [None, 40, 300])
def test_flex_block_mask_is_the_tile_map_create_block_mask_computes(block_size, seq_len, num_blocks, window):
    """flex's BlockMask is built from the rule's two key intervals per query; eager flex (all CI can run) ignores
    the tile map, so its tiles are compared here with torch's dense evaluation of the same mask_mod: the same
    partial and full tiles in the same order, with short rows, padded blocks and lengths off the 128 tile."""
    gen = torch.Generator().manual_seed(4)
    loss_mask = torch.ones(3, seq_len, dtype=torch.long)
    loss_mask[1, seq_len // 2:] = 0
    loss_mask[2, 5:] = 0  # a row with fewer candidates than blocks: invalid anchors at 0 at its end
    anchors, valid = sample_anchors(loss_mask, num_blocks, gen)
    assert not valid.all()
    mask_mod = dflash_mask_mod(anchors, block_size, seq_len, window)
    q_len = anchors.shape[1] * block_size
    ours = flex_block_mask(mask_mod, anchors, block_size, seq_len, window)
    dense = create_block_mask(mask_mod, anchors.shape[0], None, q_len, seq_len + q_len, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        torch.testing.assert_close(getattr(ours, name), getattr(dense, name), msg=name)
    if window is None and seq_len > 256:
        assert ours.full_kv_num_blocks.sum() > 0  # the comparison covers full tiles too
    assert ours.shape == dense.shape


@pytest.mark.slow
def test_compiled_elementwise_regions_compute_what_the_eager_code_does():
    """Training steps on the GPU run the norms, rotations, SwiGLU and the loss's softmax gradient compiled
    (trainer.fused); CI has no GPU, so the compiled functions are checked here on the CPU against the eager ones,
    gradients included."""
    from trainer.drafter import _rotate, rms_norm, swiglu
    from trainer.fused import compiled
    from trainer.loss import _chunk_terms

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 16, generator=gen)
    angles = torch.randn(7, 16, generator=gen)
    weight = torch.rand(16, generator=gen) + 0.5
    cases = [(rms_norm, (x, weight, 1e-6)), (_rotate, (x, angles.cos(), angles.sin())), (swiglu, (x, x.flip(-1)))]
    for fn, args in cases:
        eager_in = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        compiled_in = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        eager, fused = fn(*eager_in), compiled(fn)(*compiled_in)
        torch.testing.assert_close(fused, eager)
        eager.square().sum().backward()
        fused.square().sum().backward()
        for e, c in zip(eager_in, compiled_in):
            if isinstance(e, torch.Tensor):
                torch.testing.assert_close(c.grad, e.grad)
    logits = torch.randn(6, 50, generator=gen).to(torch.bfloat16)  # [r, V] in the head's dtype
    targets, scale = torch.randint(0, 50, (6,), generator=gen), torch.rand(6, generator=gen)  # [r] x2
    for need_grad, top_k in ((True, 5), (False, 0)):  # top_k: DFlash2's candidates
        for e, c in zip(_chunk_terms(logits, targets, scale, need_grad, top_k),
                        compiled(_chunk_terms)(logits, targets, scale, need_grad, top_k)):
            torch.testing.assert_close(c, e)


def test_autocast_training_forward_computes_what_the_served_bf16_drafter_does(head, batch):
    """The trainer keeps fp32 master weights under bf16 autocast; servers run the exported drafter with bf16 weights.
    Both must compute the same thing: bf16 queries, keys and residual stream (an fp32 norm weight under autocast
    once made them fp32, doubling attention's time on a GPU). Checked on the CPU, where autocast runs too."""
    context, block_ids, anchors, _ = batch
    drafter = make_drafter([FULL, FULL])
    served = make_drafter([FULL, FULL]).to(torch.bfloat16)
    bf16_head = TargetHead(head.embed_tokens.to(torch.bfloat16), head.lm_head.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = drafter(context, block_ids, anchors, bf16_head, "sdpa")  # [b, N, B, H]
    reference = served(context.to(torch.bfloat16), block_ids, anchors, bf16_head, "sdpa")  # [b, N, B, H]
    assert trained.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(trained, reference, rtol=0, atol=0)


def layer_args(drafter, head, context, block_ids, anchors) -> tuple:
    """run_layer's arguments for the drafter's first layer, as DFlashDrafter.forward builds them."""
    from trainer.drafter import rope_cos_sin

    cfg = drafter.config
    x = head.embed(block_ids).flatten(1, 2)  # [b, Q, H]
    hidden = drafter.hidden_norm(drafter.fc(context))  # [b, T, H]
    block_pos = (anchors[:, :, None] + torch.arange(BLOCK)).flatten(1)  # [b, Q]
    cos_b, sin_b = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta)  # [b, Q, D] x2
    rope_context = rope_cos_sin(torch.arange(context.shape[1]), cfg.head_dim, cfg.rope_theta)  # [T, D] x2
    mask = flex_block_mask(dflash_mask_mod(anchors, BLOCK, context.shape[1], None), anchors, BLOCK,
                           context.shape[1], None)
    return drafter.layers[0], x, hidden, (cos_b[:, None], sin_b[:, None]), rope_context, mask, anchors, BLOCK


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_compiled_layer_computes_what_the_eager_layer_does(architecture, head, batch):
    """Flex training on the GPU runs each decoder layer as one compiled region (trainer.drafter.run_layer). CI has no
    GPU; the same compiled region runs here on the CPU, forward only (CPU flex_attention has no backward)."""
    from trainer.drafter import run_layer
    from trainer.fused import compiled

    context, block_ids, anchors, _ = batch
    args = layer_args(make_drafter([FULL], architecture), head, context, block_ids, anchors)
    with torch.no_grad():
        torch.testing.assert_close(compiled(run_layer)(*args), run_layer(*args), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_regions_compile_once_for_a_runs_changing_rows_and_lengths(head):
    """A run's micro-batches change their rows and context length (and with it the key tiles) from one to the next;
    marked dynamic up front, the layer region, the norm and the loss chunk each compile once (Dynamo alone compiles
    static first, then again at each first change: 11 recompiles, 75 s in a real GPU run). Counted with
    a counting backend: the CPU's Inductor fails to build flex_attention with symbolic sizes (torch 2.13), and the
    graphs Dynamo captures are what decides the compilations."""
    from trainer.drafter import _leading_sizes, rms_norm, run_layer
    from trainer.fused import varying_sizes
    from trainer.loss import _chunk_sizes, _chunk_terms

    drafter = make_drafter([FULL])
    gen = torch.Generator().manual_seed(3)
    # rows 3, 2, 4; context 140, 240, 290 positions (2-3 key tiles of 128 with the 28 block slots: a size of 1 would
    # be a constant anyway, as no real run has); loss chunks of 5, 9 rows
    # (logits in the head's dtype, bf16: in fp32 the gradient would be built in the logits themselves)
    cases = [(run_layer, _layer_sizes, layer_args(drafter, head, *micro_batch(lengths, seed)[:3]))
             for seed, lengths in enumerate([(140, 33, 20), (240, 12), (25, 290, 30, 44)])]
    cases += [(rms_norm, _leading_sizes, (torch.randn(rows, length, HIDDEN, generator=gen), torch.ones(HIDDEN), 1e-6))
              for rows, length in [(3, 40), (2, 150), (4, 28)]]
    cases += [(_chunk_terms, _chunk_sizes, (torch.randn(rows, VOCAB, generator=gen).bfloat16(),
                                            torch.randint(0, VOCAB, (rows,)), torch.rand(rows), True))
              for rows in (5, 9)]
    for marked in (False, True):
        torch._dynamo.reset()
        graphs = []

        def count(graph, example_inputs):  # a Dynamo backend that runs the captured graph as it is, counted
            graphs.append(graph)
            return graph.forward

        with torch.no_grad():
            for fn, sizes, args in cases:
                with varying_sizes(sizes, args) if marked else contextlib.nullcontext():
                    got = torch.compile(fn, backend=count)(*args)
                for g, want in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(fn(*args))):
                    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
        # unmarked: each region once static, then again when its sizes first change (here all at once)
        assert len(graphs) == (3 if marked else 3 + 3), marked
