"""The whole DFlash drafter in one file: config, Qwen3-style layers, the batched training forward and `draft`.

Shapes: b = sequences, T = context positions, K*H = concatenated tapped target states, N = blocks per sequence,
B = block size, Q = N*B block slots, H = hidden size, D = head_dim, hq / hkv = query / key-value heads.
The context (tapped target states) enters every layer only as extra keys/values in front of the block's own,
never the residual stream; which key each slot may see is trainer.attention_mask's rule.
Module names match the exported tensor names (fc, hidden_norm, layers.{i}.self_attn.q_proj, ..., norm); the
frozen embed_tokens / lm_head live in a TargetHead passed to each call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashq import defaults
from dflashq.exceptions import ConfigError
from dflashq.layer_ids import default_layer_ids
from trainer.attention_mask import DenseGroup, dense_groups, dflash_mask_mod, flex_block_mask, with_lengths
from trainer.dflash2 import CandidateSelector, GroupedDynamicCausalConv, SelectorLoss, selector_loss
from trainer.fused import compiled, fused
from trainer.target_head import TargetHead

LAYER_TYPES = ("sliding_attention", "full_attention")
ARCHITECTURES = ("dflash", "dflash2")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # unused by DFlash
INITIALIZER_RANGE = 0.02  # Qwen3's init std for a drafter trained from scratch

Attention = Literal["auto", "flex", "sdpa"]


@dataclasses.dataclass
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]  # z-lab convention: id t = output of target decoder layer t = hidden_states[t+1]
    mask_token_id: int
    layer_types: list[str]
    sliding_window: int
    num_target_layers: int
    architecture: str = defaults.ARCHITECTURE  # "dflash2" adds trainer.dflash2's convolutions and selector
    conv_kernel_size: int = defaults.CONV_KERNEL_SIZE
    conv_group_size: int = defaults.CONV_GROUP_SIZE
    selector_rank: int = defaults.SELECTOR_RANK
    selector_top_k: int = defaults.SELECTOR_TOP_K

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ConfigError(
                f"layer_types {self.layer_types} must list {self.num_layers} entries, each one of {LAYER_TYPES}."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is not a row of the target's {self.vocab_size}-token "
                "embedding; set train.mask_token_id to a reserved token of the target vocabulary."
            )
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_key_value_heads "
                f"{self.num_key_value_heads}, and head_dim {self.head_dim} even."
            )
        if self.block_size < 2:
            raise ConfigError(f"block_size {self.block_size} must be at least 2 (one anchor plus one draft slot).")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} must be one of {ARCHITECTURES}; set train.architecture.")
        if self.dflash2 and (self.conv_group_size < 1 or self.hidden_size % self.conv_group_size):
            raise ConfigError(f"conv_group_size {self.conv_group_size} must divide the hidden size {self.hidden_size}; "
                              "set train.conv_group_size.")
        if self.dflash2 and not 1 <= self.selector_top_k <= self.vocab_size:
            raise ConfigError(f"selector_top_k {self.selector_top_k} must be between 1 and the vocabulary size "
                              f"{self.vocab_size}; set train.selector_top_k.")

    @property
    def dflash2(self) -> bool:
        return self.architecture == "dflash2"

    @property
    def num_tapped(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def default_for_target(
        cls,
        target_config: Mapping[str, Any] | Any,
        num_layers: int = defaults.NUM_LAYERS,
        layer_ids: list[int] | None = None,
        *,
        mask_token_id: int,
        block_size: int = defaults.BLOCK_SIZE,
        sliding_window: int = defaults.SLIDING_WINDOW,
        rope_theta: float = defaults.ROPE_THETA,
        **overrides: Any,
    ) -> DrafterConfig:
        """Drafter defaults for a target (a config.json dict or a Transformers config; a multimodal config's
        `text_config` is used). Attention is the released drafters' 32 query / 8 kv heads of 128 whatever the
        hidden size (q_proj may be wider than H), so tensor parallelism 1/2/4/8 divides the heads in vLLM and
        SGLang; targets under hidden size 1024 (test and demo models) keep their own attention shape. The MLP
        width follows the target; RoPE is the drafter's own plain RoPE; every layer is full attention (what stock
        servers run). `overrides` replace any field."""
        target = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
        target = target.get("text_config") or target
        hidden = target["hidden_size"]
        num_target_layers = target["num_hidden_layers"]
        if hidden >= defaults.OWN_ATTENTION_BELOW_HIDDEN:
            num_heads, num_kv_heads, head_dim = defaults.DRAFTER_ATTENTION
        else:
            num_heads = target["num_attention_heads"]
            num_kv_heads = target.get("num_key_value_heads") or num_heads
            head_dim = target.get("head_dim") or hidden // num_heads
        fields = dict(
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=target.get("intermediate_size") or 3 * hidden,
            rms_norm_eps=target.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=target.get("max_position_embeddings", 32768),
            vocab_size=target["vocab_size"],
            block_size=block_size,
            target_layer_ids=list(layer_ids) if layer_ids else default_layer_ids(num_target_layers, num_layers),
            mask_token_id=mask_token_id,
            layer_types=["full_attention"] * num_layers,
            sliding_window=sliding_window,
            num_target_layers=num_target_layers,
        )
        fields.update(overrides)
        return cls(**fields)


def drafter_architecture(train_settings) -> dict[str, Any]:
    """The DrafterConfig fields that [train] settings give for the architecture (DFlash2's sizes only for it)."""
    fields = ("architecture", *DFLASH2_FIELDS) if train_settings.architecture == "dflash2" else ("architecture",)
    return {name: getattr(train_settings, name) for name in fields}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))  # [size]
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return fused(rms_norm, x, torch.is_grad_enabled(), _leading_sizes)(x, self.weight, self.eps)  # [..., size]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Normalise in fp32 and scale in the input dtype, as Qwen3 does (bf16 statistics lose acceptance). The fp32
    # master weight is cast too: under autocast an fp32 product would carry fp32 queries and keys into attention
    # (twice its time) and an fp32 residual stream, where the served bf16 model has bf16 throughout.
    x32 = x.float()  # [..., size]
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., size]
    return weight.to(x.dtype) * normed.to(x.dtype)  # [..., size]


def _leading_sizes(x: Tensor, *rest):
    # rows and sequence length change from call to call (the context's and the blocks'); the hidden size not
    return [(x, range(x.dim() - 1))]


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Plain (non-partial) RoPE tables for integer positions [...] -> cos, sin [..., D] in fp32."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim  # [D/2]
    inv_freq = theta**-exponents  # [D/2]
    angles = positions.float()[..., None] * inv_freq  # [..., D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., D]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., S, D] (half-split pairs i, i + D/2, the Transformers convention); cos/sin broadcast to it."""
    return fused(_rotate, x, torch.is_grad_enabled())(x, cos, sin)  # [..., S, D]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x32 = x.float()  # [..., S, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)  # [..., S, D]
    return (x32 * cos + rotated * sin).to(x.dtype)  # [..., S, D]


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [b, hkv, s, D]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, hkv, s, D]
        return apply_rope(k, cos, sin), v  # [b, hkv, s, D] x2

    def forward(self, x: Tensor, context: Tensor, rope_block: tuple[Tensor, Tensor],
                rope_context: tuple[Tensor, Tensor], mask: list[DenseGroup] | BlockMask) -> Tensor:
        """x [b, Q, H] block slots, context [b, T, H]; mask: a BlockMask (flex) or the groups of blocks that one
        SDPA call each attends (trainer.attention_mask.dense_groups)."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)  # [b, hq, Q, D]
        q = apply_rope(q, *rope_block)  # [b, hq, Q, D]
        k_ctx, v_ctx = self._keys_values(context, *rope_context)  # [b, hkv, T, D] x2
        k_blk, v_blk = self._keys_values(x, *rope_block)  # [b, hkv, Q, D] x2
        if isinstance(mask, BlockMask):
            k = torch.cat([k_ctx, k_blk], dim=2)  # [b, hkv, T+Q, D]
            v = torch.cat([v_ctx, v_blk], dim=2)  # [b, hkv, T+Q, D]
            out = _flex(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True)  # [b, hq, Q, D]
        else:
            if q.is_cuda:  # the memory-efficient kernel takes no GQA: one key/value head per query head
                repeat = self.num_heads // self.num_kv_heads
                k_ctx, v_ctx, k_blk, v_blk = (t.repeat_interleave(repeat, 1) for t in (k_ctx, v_ctx, k_blk, v_blk))
            out = torch.cat([_masked_attention(
                q[:, :, g.queries],  # [b, hq, Qg, D]
                torch.cat([k_ctx[:, :, : g.context], k_blk[:, :, g.queries]], dim=2),  # [b, hkv or hq, Cg+Qg, D]
                torch.cat([v_ctx[:, :, : g.context], v_blk[:, :, g.queries]], dim=2),  # [b, hkv or hq, Cg+Qg, D]
                g.mask) for g in mask], dim=2)  # [b, hq, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))  # [b, Q, H]


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA with a boolean mask. On CUDA pinned to the memory-efficient kernel: torch's first choice there, cuDNN,
    builds an execution plan for every new shape, and every micro-batch of a run brings new shapes (several times
    slower steps: docs/performance.md)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [b, hq, Qg, D]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [b, hq, Qg, D]


def _flex(on_gpu: bool):
    # Eager flex_attention materialises the whole score matrix; only the compiled kernel is fused (CUDA). Dynamo's
    # automatic dynamic shapes: the first shape compiles static, the second makes only the sizes that changed
    # symbolic (rows, context length), while the query length (anchors x block: trainer.anchors' exact count in
    # training) stays a constant of the kernel; dynamic=True made it symbolic too, which halved the kernel's speed
    # (docs/performance.md). Inside a compiled layer region the
    # region's compilation takes flex_attention in.
    return compiled(flex_attention) if on_gpu and not torch.compiler.is_compiling() else flex_attention


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # [..., I] x2
        return self.down_proj(fused(swiglu, x, torch.is_grad_enabled())(gate, up))  # [..., H]


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up  # [..., I]


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)
        convs = [GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
                 for _ in range(2)] if config.dflash2 else [None, None]
        self.attention_conv, self.mlp_conv = convs  # DFlash2: around each sublayer

    def forward(self, x: Tensor, context: Tensor, rope_block, rope_context, mask, block_size: int) -> Tensor:
        """block_size: B of the Q = N*B slots of x (DFlash2's convolutions stay inside each block)."""
        def attend(h: Tensor) -> Tensor:
            return self.self_attn(h, context, rope_block, rope_context, mask)  # [b, Q, H]

        h = self.input_layernorm(x)  # [b, Q, H]
        x = x + (attend(h) if self.attention_conv is None else self.attention_conv(h, attend, block_size))  # [b, Q, H]
        h = self.post_attention_layernorm(x)  # [b, Q, H]
        return x + (self.mlp(h) if self.mlp_conv is None else self.mlp_conv(h, self.mlp, block_size))  # [b, Q, H]


def _layer_sizes(layer, x, context, rope_block, rope_context, mask: BlockMask, anchors: Tensor, block_size: int):
    # rows and the context length T, and with T the key tiles, change from one micro-batch to the next; the query
    # length N*B (and its tiles) stays a constant of flex's kernel: symbolic, it halved the kernel's speed (_flex).
    # The key length T + N*B is computed from these inside the region (run_layer), so no int needs marking.
    return [(x, [0]), (context, [0, 1]), *((t, [0]) for t in rope_block), *((t, [0]) for t in rope_context),
            (mask.kv_num_blocks, [0]), (mask.full_kv_num_blocks, [0]),
            (mask.kv_indices, [0, 3]), (mask.full_kv_indices, [0, 3]),
            *((t, [0, 2]) for t in (mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)),
            (anchors, [0])]  # [b, N], read by the mask rule


def uses_flex(attention: Attention, x: Tensor) -> bool:
    """Whether a forward over `x` runs flex attention: asked for, or "auto" on the GPU."""
    return attention == "flex" or (attention == "auto" and x.is_cuda)


def run_layer(layer: DrafterLayer, x: Tensor, context: Tensor, rope_block, rope_context, mask, anchors: Tensor,
              block_size: int) -> Tensor:
    # A whole layer as one compiled region in flex training: small drafters' steps waited on the CPU launching
    # hundreds of kernels (docs/performance.md). One function for every layer: Dynamo takes the parameters as
    # inputs, so the layers share one compilation. `anchors` [b, N]: what the mask rule reads, passed so that its
    # rows are marked with the others (_layer_sizes).
    if isinstance(mask, BlockMask):
        mask = with_lengths(mask, x.shape[1], context.shape[1] + x.shape[1])
    return layer(x, context, rope_block, rope_context, mask, block_size)  # [b, Q, H]


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_tapped * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank,
                                                    config.selector_top_k) if config.dflash2 else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=INITIALIZER_RANGE)
        for module in self.modules():
            if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
                module.init_weights()

    def forward(self, context_states: Tensor, block_ids: Tensor, anchors: Tensor, head: TargetHead,
                attention: Attention = "auto") -> Tensor:
        """All blocks of a batch in one pass (no loop over blocks).

        context_states [b, T, K*H] tapped target states (right padding is never seen: c < a_j < length);
        block_ids [b, N, B] (trainer.anchors.gather_blocks); anchors [b, N] long, the position of each block's
        slot 0. Padded (invalid) blocks are computed like the others and only need to be left out of the loss:
        blocks never see each other. attention: "flex" (BlockMask), "sdpa" (boolean masks per group of blocks), or "auto"
        (flex on CUDA, else SDPA). Returns the final-normed hidden states of every slot [b, N, B, H].
        """
        cfg = self.config
        b, num_blocks, block_size = block_ids.shape
        context_len = context_states.shape[1]
        context = self.hidden_norm(self.fc(context_states.to(self.fc.weight.dtype)))  # [b, T, H]
        x = head.embed(block_ids).flatten(1, 2).to(context.dtype)  # [b, Q, H]
        offsets = torch.arange(block_size, device=anchors.device)  # [B]
        block_pos = (anchors[:, :, None] + offsets).flatten(1)  # [b, Q]
        cos_b, sin_b = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta)  # [b, Q, D] x2
        context_pos = torch.arange(context_len, device=anchors.device)  # [T]
        cos_c, sin_c = rope_cos_sin(context_pos, cfg.head_dim, cfg.rope_theta)  # [T, D] x2
        rope_block = (cos_b[:, None], sin_b[:, None])  # [b, 1, Q, D] x2
        rope_context = (cos_c, sin_c)  # [T, D] x2
        use_flex = uses_flex(attention, x)
        if use_flex and torch.is_grad_enabled():
            # the frozen embedding gives no gradient; asking for one (a few small products) lets the first layer
            # share the compiled region of the others instead of compiling its own variant
            x.requires_grad_(True)
        masks = {}
        for layer_type in dict.fromkeys(cfg.layer_types):
            window = cfg.sliding_window if layer_type == "sliding_attention" else None
            mask_mod = dflash_mask_mod(anchors, block_size, context_len, window)
            if use_flex:
                masks[layer_type] = flex_block_mask(mask_mod, anchors, block_size, context_len, window)
            else:
                masks[layer_type] = dense_groups(mask_mod, anchors, block_size, context_len, defaults.SDPA_GROUP_BLOCKS)
        for layer, layer_type in zip(self.layers, cfg.layer_types):
            # FSDP2 layers (train.parallel = "fsdp") stay eager: their all-gather hooks inside the compiled region have
            # not been run on a GPU
            run = fused(run_layer, x, torch.is_grad_enabled() and use_flex and not isinstance(layer, FSDPModule),
                        _layer_sizes)
            x = run(layer, x, context, rope_block, rope_context, masks[layer_type], anchors, block_size)  # [b, Q, H]
        return self.norm(x).view(b, num_blocks, block_size, -1)  # [b, N, B, H]

    @torch.no_grad()
    def draft(self, context_states: Tensor, last_token: Tensor, start_pos: int | Tensor, head: TargetHead,
              attention: Attention = "auto", block_size: int | None = None) -> Tensor:
        """One speculative-decoding step: block [last_token, MASK x (B-1)] at positions start_pos.. attending to
        the committed context positions < start_pos (no KV cache: the context is re-projected on every call).

        context_states [b, C, K*H] tapped states of committed positions (C >= start_pos; later ones are unseen);
        last_token [b] the newest token, whose target states are not computed yet; start_pos an int or [b] long
        (per-row positions of last_token); block_size B (default the config's) shorter for the last block of a
        generation, as the reference drafts it. Returns logits [b, B-1, V] of slots 1..B-1 (argmax = DFlash's
        greedy drafts; `propose` gives DFlash2's).
        """
        hidden = self._draft_states(context_states, last_token, start_pos, head, attention, block_size)  # [b, B-1, H]
        return head.logits(hidden.to(head.lm_head.dtype)).float()  # [b, B-1, V]

    @torch.no_grad()
    def propose(self, context_states: Tensor, last_token: Tensor, start_pos: int | Tensor, head: TargetHead,
                attention: Attention = "auto", block_size: int | None = None) -> Tensor:
        """The greedy drafts [b, B-1] of `draft`'s block: each slot's argmax (DFlash), or the candidate selector's
        chain from last_token over the logits in the head's dtype, as the reference's propose() (DFlash2)."""
        hidden = self._draft_states(context_states, last_token, start_pos, head, attention, block_size)  # [b, B-1, H]
        logits = head.logits(hidden.to(head.lm_head.dtype))  # [b, B-1, V]
        if self.candidate_selector is None:
            return logits.argmax(-1)  # [b, B-1]
        return self.candidate_selector.chain(hidden, logits, last_token)  # [b, B-1]

    def _draft_states(self, context_states: Tensor, last_token: Tensor, start_pos: int | Tensor, head: TargetHead,
                      attention: Attention, block_size: int | None) -> Tensor:
        b = last_token.shape[0]
        anchors = torch.as_tensor(start_pos, device=last_token.device).expand(b).reshape(b, 1)  # [b, 1]
        block_ids = torch.full((b, 1, block_size or self.config.block_size), self.config.mask_token_id,
                               dtype=torch.long, device=last_token.device)  # [b, 1, B]
        block_ids[:, 0, 0] = last_token
        return self(context_states, block_ids, anchors, head, attention)[:, 0, 1:]  # [b, B-1, H]

    def selector_loss(self, *args, **kwargs) -> SelectorLoss:
        """trainer.dflash2.selector_loss of this drafter's selector (a method, so that FSDP gathers its weights)."""
        return selector_loss(self.candidate_selector, *args, **kwargs)
