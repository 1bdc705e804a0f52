"""Greedy decoding of attention-only targets with a static KV cache, each decode step one CUDA graph replay.

Why: Transformers' `generate` is launch bound for small targets (as is its continuous batching, `generate_batch`):
the GPU sits mostly idle between the Python and kernel-launch work of each step. Here a batch's left-padded rows share one preallocated cache
[layers, rows, kv_heads, width + max_new_tokens, head_dim]; the prompt is one forward, and every decode step (all
layers, the head, the argmax and the bookkeeping) is captured once as a CUDA graph and replayed, so a step costs
no Python or launch work (several times generate's tokens/s: docs/performance.md; `seconds` says where a batch's
time goes). It runs the
target's own modules (embedding, norms, projections, rotary embedding, MLP, head); only the attention over the cache
is written here, as softmax(q k^T * scaling) v per key/value head group. On the CPU the same step runs eagerly (tests
check it against `generate`, token for token).

Targets: Llama, Qwen2, Qwen3, Mistral-style decoders whose layers are all full attention (`unsupported_reason`).
"""

from __future__ import annotations

import collections
import time

import torch

# the model types whose layer layout this decoder reproduces: pre-norm decoder layers of q/k/v/o projections (Qwen3 with
# per-head q/k RMSNorms), rotary embedding from the model's own rotary_emb, no logit soft-capping
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PROMPT_TOKENS = 65536  # prompt tokens per prompt forward: rows go through it in slices of this many tokens
DONE_CHECK_STEPS = 16  # decode steps between looks at whether every row has ended (each look waits for the GPU)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this decoder cannot run `model` (None: it can)."""
    config = model.config.get_text_config()
    if config.model_type not in SUPPORTED_TYPES:
        return f"its architecture {config.model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if layer_types != {"full_attention"} or sliding:
        return "it has sliding-window or other non-full-attention layers"
    return None


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids, left-padded so every row's next token lands in the same column: ids [R, width] and each row's
    padding count [R] (both on the CPU)."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
    return ids, torch.tensor([width - len(row) for row in rows])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Transformers applies it (rotate_half convention); cos/sin [R, S, d] -> per head."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [R, 1, S, d]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class StaticDecoder:
    """decode(rows) -> each row's generated ids (max_new_tokens of them, or fewer once every row has ended; a row's
    ids run on past its own end id, which the caller cuts). Greedy; one CUDA graph per batch shape on a GPU."""

    def __init__(self, model: torch.nn.Module, max_new_tokens: int, eos_ids: set[int], pad_id: int):
        self.model, self.max_new_tokens, self.pad_id = model, max_new_tokens, pad_id
        self.core = model.model  # embed_tokens, layers, norm, rotary_emb
        config = model.config.get_text_config()
        self.layers = len(self.core.layers)
        attention = self.core.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = attention.scaling
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.eos = torch.tensor(sorted(eos_ids), device=self.device)
        self.graph = None
        self.shape = None  # (rows, cache width) the graph and buffers were made for
        # where the time went, summed over batches (the GPU waited for at each phase's end): prompt forwards, graph
        # captures, decode steps; and steps x rows decoded, finished rows included (what the decode time bought)
        self.seconds: collections.Counter = collections.Counter()
        self.row_steps = 0

    # --- the layer stack, shared by the prompt forward and the decode step -----------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The target's layers over ids [R, S] at positions [R, S]; attend(layer, q, k, v) -> [R, heads, S, d].
        Returns the last position's logits [R, V]."""
        x = self.core.embed_tokens(ids)  # [R, S, H]
        cos, sin = self.core.rotary_emb(x, positions)  # [R, S, d] each
        rows, length = ids.shape
        for index, layer in enumerate(self.core.layers):
            attention = layer.self_attn
            h = layer.input_layernorm(x)  # [R, S, H]
            q = attention.q_proj(h).view(rows, length, -1, self.head_dim)  # [R, S, heads, d]
            k = attention.k_proj(h).view(rows, length, -1, self.head_dim)  # [R, S, kv_heads, d]
            v = attention.v_proj(h).view(rows, length, -1, self.head_dim).transpose(1, 2)  # [R, kv_heads, S, d]
            if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head before the rotation
                q, k = attention.q_norm(q), attention.k_norm(k)
            q = _rotate(q.transpose(1, 2), cos, sin)  # [R, heads, S, d]
            k = _rotate(k.transpose(1, 2), cos, sin)  # [R, kv_heads, S, d]
            out = attend(index, q, k, v)  # [R, heads, S, d]
            x = x + attention.o_proj(out.transpose(1, 2).reshape(rows, length, -1))  # [R, S, H]
            x = x + layer.mlp(layer.post_attention_layernorm(x))  # [R, S, H]
        return self.model.lm_head(self.core.norm(x[:, -1]))  # [R, V]

    # --- one batch ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, rows: list[list[int]]) -> list[list[int]]:
        started = time.perf_counter()
        width = max(map(len, rows))
        self._buffers(len(rows), width + self.max_new_tokens)
        ids, pads = (t.to(self.device) for t in left_padded(rows, self.pad_id))
        columns = torch.arange(width, device=self.device)
        positions = (columns[None, :] - pads[:, None]).clamp(min=0)  # [R, width]: each row counts from its first token
        self.visible.zero_()
        self.visible[:, :width] = columns[None, :] >= pads[:, None]  # [R, T]: real prompt tokens
        causal = columns[None, :] <= columns[:, None]  # [width, width]
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        groups = self.heads // self.kv_heads
        logits = []
        step = max(1, PROMPT_TOKENS // width)
        for lo in range(0, len(rows), step):  # rows in slices: the [rows, width, width] mask stays small
            hi = min(len(rows), lo + step)
            # a padding query sees itself only (its output is never used; an empty row would make NaNs)
            mask = (causal[None] & self.visible[lo:hi, None, :width]) | eye  # [r, width, width]

            def attend_prompt(index, q, k, v):
                self.keys[index, lo:hi, :, :width] = k
                self.values[index, lo:hi, :, :width] = v
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask[:, None],
                    scale=self.scaling)  # [r, heads, width, d]

            logits.append(self._forward(ids[lo:hi], positions[lo:hi], attend_prompt))  # [r, V]
        logits = torch.cat(logits)  # [R, V]
        self.tokens.copy_(logits.argmax(-1)[:, None])
        self.positions.copy_(positions[:, -1:] + 1)
        self.column.fill_(width)
        self.step.zero_()
        self.generated[:, 0] = self.tokens[:, 0]
        self.done.copy_(self._ended(self.tokens[:, 0]))
        started = self._lap("prompt", started)
        steps = 1
        while steps < self.max_new_tokens:
            if self.graph is None and self.device.type == "cuda":
                self._capture()
                started = self._lap("capture", started)
            self._replay()
            steps += 1
            if steps % DONE_CHECK_STEPS == 0 and bool(self.done.all()):
                break
        generated = self.generated[:, :steps].tolist()
        self._lap("decode", started)
        self.row_steps += len(rows) * (steps - 1)
        return generated

    def _lap(self, phase: str, started: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] += now - started
        return now

    def _ended(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.eos).any(-1)  # [R]; an elementwise test, safe to capture

    def _decode_step(self) -> None:
        """One token for every row, entirely on the device (no host sync: it is captured as a graph)."""
        self.visible.index_fill_(1, self.column, True)  # the new token sees itself
        rows = self.tokens.shape[0]
        groups = self.heads // self.kv_heads

        def attend_cache(index, q, k, v):
            keys, values = self.keys[index], self.values[index]  # [R, kv_heads, T, d]
            keys.index_copy_(2, self.column, k)
            values.index_copy_(2, self.column, v)
            q = q.reshape(rows, self.kv_heads, groups, self.head_dim)  # [R, kv_heads, g, d]: one query per head
            scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scaling  # [R, kv_heads, g, T]
            scores = scores.masked_fill(~self.visible[:, None, None, :], float("-inf"))
            out = torch.matmul(scores.softmax(-1).to(values.dtype), values)  # [R, kv_heads, g, d]
            return out.view(rows, self.heads, 1, self.head_dim)  # [R, heads, 1, d]

        logits = self._forward(self.tokens, self.positions, attend_cache)  # [R, V]
        token = logits.argmax(-1)  # [R]
        self.step += 1
        self.generated.index_copy_(1, self.step, token[:, None])
        self.done |= self._ended(token)
        self.tokens.copy_(token[:, None])
        self.positions += 1
        self.column += 1

    def _buffers(self, rows: int, width: int) -> None:
        """The cache and step state for `rows` x `width`; kept (with the captured graph) while the shape repeats."""
        if self.shape == (rows, width):
            return
        self.graph, self.shape = None, None
        self.keys = self.values = None  # free the last batch's cache before the next one is allocated
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        cache = (self.layers, rows, self.kv_heads, width, self.head_dim)
        self.keys = torch.zeros(cache, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(cache, dtype=self.dtype, device=self.device)
        self.visible = torch.zeros((rows, width), dtype=torch.bool, device=self.device)
        self.tokens = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)
        self.step = torch.zeros(1, dtype=torch.long, device=self.device)
        self.generated = torch.full((rows, self.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.shape = (rows, width)

    def _replay(self) -> None:
        if self.graph is None:  # the CPU: no graphs, the same step eagerly
            return self._decode_step()
        self.graph.replay()

    def _capture(self) -> None:
        """Capture the decode step on the state as it stands (the first replay runs it): the warm-up runs that
        capture needs (cuBLAS workspaces, lazy init) work on a saved copy of the state, which is then put back."""
        state = (self.visible, self.tokens, self.positions, self.column, self.step, self.generated, self.done)
        saved = [t.clone() for t in state]
        column = int(self.column)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._decode_step()  # writes the cache at `column`, which the first replay rewrites the same way
        torch.cuda.current_stream().wait_stream(stream)
        for live, copy in zip(state, saved):
            live.copy_(copy)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._decode_step()
        assert int(self.column) == column  # capture records, it does not run
