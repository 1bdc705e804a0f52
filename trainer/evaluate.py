"""Drafter evaluation: real greedy speculative decoding against the target (tau, checked lossless against plain
greedy decoding), and offline per-slot accuracy / EAL over held-out blobs.

Target KV cache: hybrid Gated-DeltaNet targets (Qwen3.5/3.6, Qwen3-Next) keep a recurrent state per linear-attention
layer that cannot be rolled back after a rejected draft (Transformers reports `cache.is_croppable == False`, and its
own assisted decoding refuses such caches; from 5.25 they can be, but only once the layers record their past states,
which is off). For those, the cache is copied before each verification and, when a draft is rejected, the copy is
advanced over the accepted tokens only (one extra target forward of accepted + 1 tokens).
Croppable caches (plain attention) are cropped instead. tau counts verification passes only, never that replay.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from dflashq import compat
from dflashq.blob import Blob
from dflashq.capture import HiddenStateCapture
from dflashq.exceptions import ConfigError, InputError
from dflashq.layer_ids import CONVENTION
from dflashq.target import eos_ids, load_target
from trainer.anchors import gather_blocks, sample_anchors
from trainer.drafter import DFlashDrafter
from trainer.export import load_exported
from trainer.loss import dflash_loss, expected_acceptance_length
from trainer.step import collate
from trainer.target_head import TargetHead


def target_head(target_model: torch.nn.Module) -> TargetHead:
    """The loaded target's own embedding and LM head, shared (not copied) with the drafter."""
    return TargetHead(target_model.get_input_embeddings().weight.detach(),
                      target_model.get_output_embeddings().weight.detach())


def accept_length(proposals: list[int], target_greedy: list[int]) -> int:
    """How many leading proposals equal the target's greedy token at the same position (target_greedy[i] is the
    target's choice after the last token and proposals[:i])."""
    n = 0
    while n < len(proposals) and n < len(target_greedy) and proposals[n] == target_greedy[n]:
        n += 1
    return n


def per_position_acceptance(committed: Iterable[list[int]], draft_slots: int) -> list[float]:
    """The share of verification passes, pooled over prompts, whose k-th draft token (k = 1..draft_slots) was
    accepted, from each pass's committed tokens (its accepted drafts and the target's own token): as vLLM's
    per-position counters count, except that a pass cut by EOS or max_new_tokens counts only what it committed."""
    passes = [n for one in committed for n in one]
    if not passes:
        return []
    return [round(sum(n > k for n in passes) / len(passes), 4) for k in range(1, draft_slots + 1)]


def _done(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> bool:
    # both loops stop at the first EOS, so an EOS can only be the last token
    return len(tokens) >= max_new_tokens or tokens[-1] in eos_ids


def _forward(model: torch.nn.Module, input_ids: Tensor, cache=None, **kwargs):
    """One target forward with its cache under whichever name this Transformers uses; returns (output, cache)."""
    name = compat.cache_keyword(type(model))
    out = model(input_ids=input_ids, use_cache=True, **({name: cache} if cache is not None else {}), **kwargs)
    return out, getattr(out, name)


@dataclasses.dataclass
class SpeculativeResult:
    tokens: list[int]  # generated ids (EOS included when reached)
    committed: list[int]  # tokens committed by each verification pass, as dflash_generate's acceptance_lengths

    @property
    def tau(self) -> float:
        return sum(self.committed) / len(self.committed) if self.committed else 0.0


@torch.inference_mode()
def speculative_generate(target_model: torch.nn.Module, drafter: DFlashDrafter, head: TargetHead,
                         prompt_ids: list[int] | Tensor, max_new_tokens: int, eos_ids: set[int] | list[int]
                         ) -> SpeculativeResult:
    """Greedy speculative decoding of one prompt: the drafter proposes up to B-1 tokens per pass, the target
    verifies them in one forward and keeps the longest prefix equal to its own greedy choices plus one bonus token.

    Counted as the reference `dflash_generate` counts: the first token comes from the prefill and is no pass's; a
    pass commits only up to the first EOS and up to max_new_tokens; the last block shrinks to the tokens left
    (at most B, the last committed token included), so its drafter pass and its verification are shorter too."""
    eos_ids = set(eos_ids)
    device = next(target_model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)  # [1, P]
    tapped = HiddenStateCapture(target_model, drafter.config.target_layer_ids, stop_after_deepest=False)
    try:
        out, cache = _forward(target_model, prompt)
        context = tapped.take().flatten(2)  # [1, P, K*H] states of every position the target has processed
        tokens = [int(out.logits[0, -1].argmax())]
        committed: list[int] = []
        while not _done(tokens, max_new_tokens, eos_ids):
            left = max_new_tokens - len(tokens)
            block_size = min(drafter.config.block_size, left + 1)
            last = torch.tensor([tokens[-1]], device=device)  # [1]
            # DFlash: each slot's argmax; DFlash2: its candidate selector's chain, as the reference's propose()
            drafts = drafter.propose(context, last, context.shape[1], head, attention="sdpa",
                                     block_size=block_size)[0]  # [block_size - 1]
            block = torch.cat([last, drafts])[None]  # [1, block_size]
            snapshot = None if compat.cache_croppable(cache) else copy.deepcopy(cache)
            out, cache = _forward(target_model, block, cache)
            greedy = out.logits[0].argmax(-1).tolist()  # [block_size] target's next token after each position
            n = accept_length(drafts.tolist(), greedy)
            new = (drafts[:n].tolist() + [greedy[n]])[:left]
            eos_at = next((i for i, t in enumerate(new) if t in eos_ids), None)
            new = new if eos_at is None else new[: eos_at + 1]
            tokens += new
            committed.append(len(new))
            if _done(tokens, max_new_tokens, eos_ids):
                break
            context = torch.cat([context, tapped.take().flatten(2)[:, : n + 1]], dim=1)  # [1, C + n + 1, K*H]
            rejected = block.shape[1] - (n + 1)
            if rejected and snapshot is None:
                cache.crop(-rejected)
            elif rejected:
                cache = snapshot
                _forward(target_model, block[:, : n + 1], cache, logits_to_keep=1)
                tapped.take()  # the replay's states equal the verification's, already kept
    finally:
        tapped.close()
    return SpeculativeResult(tokens, committed)


@torch.inference_mode()
def greedy_generate(target_model: torch.nn.Module, prompt_ids: list[int] | Tensor, max_new_tokens: int,
                    eos_ids: set[int] | list[int]) -> list[int]:
    """Plain greedy decoding with the target's cache, one token per forward: the reference speculative decoding
    must reproduce token for token."""
    eos_ids = set(eos_ids)
    device = next(target_model.parameters()).device
    out, cache = _forward(target_model, torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1))
    tokens = [int(out.logits[0, -1].argmax())]
    while not _done(tokens, max_new_tokens, eos_ids):
        out, cache = _forward(target_model, torch.tensor([[tokens[-1]]], device=device), cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def read_prompts(path: str | Path) -> list[str | list[dict]]:
    """A JSONL prompts file: one object per line with `prompt` (a user message) or `messages` (a chat)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompts file {path} does not exist; pass a JSONL file with `prompt` or `messages` lines.")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompts.append(record["messages"] if "messages" in record else record["prompt"])
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{path} line {number} is not a JSON object with `prompt` or `messages`.") from None
    if not prompts:
        raise InputError(f"prompts file {path} holds no prompt; add JSONL lines with `prompt` or `messages`.")
    return prompts


def chat_prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """A prompt (one user message, or a chat) through the target's chat template, up to where the assistant speaks:
    every engine that evaluates a drafter starts from these ids."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


class PromptEvaluator:
    """The target and an exported drafter, loaded once: speculative decoding of one prompt at a time (chat template
    applied, greedy), optionally checked against plain greedy decoding."""

    def __init__(self, target_path: str, drafter_dir: str | Path, device: str | torch.device = "cpu"):
        from transformers import AutoTokenizer

        self.target = load_target(target_path, device)
        # in the target's dtype, as a server runs it (bf16 on GPU; on the CPU the bf16 export upcasts exactly)
        self.drafter = load_exported(drafter_dir, device).to(next(self.target.parameters()).dtype)
        text_config = self.target.config.get_text_config()
        config = self.drafter.config
        if (config.hidden_size, config.vocab_size) != (text_config.hidden_size, text_config.vocab_size):
            raise ConfigError(
                f"drafter {drafter_dir} (hidden {config.hidden_size}, vocab {config.vocab_size}) was not trained "
                f"for target {target_path} (hidden {text_config.hidden_size}, vocab {text_config.vocab_size})."
            )
        self.tokenizer = AutoTokenizer.from_pretrained(target_path)
        self.head = target_head(self.target)
        self.stop_ids = eos_ids(self.target, self.tokenizer)

    def evaluate(self, prompt: str | list[dict], max_new_tokens: int, check_lossless: bool = True) -> dict:
        """tau, passes and text of one prompt; lossless (None when not checked) with the first differing index and
        the logit margin between the two picks there (mismatch_margin).
        The greedy check costs a target forward per token, more than the speculative run itself."""
        prompt_ids = chat_prompt_ids(self.tokenizer, prompt)
        spec = speculative_generate(self.target, self.drafter, self.head, prompt_ids, max_new_tokens, self.stop_ids)
        mismatch = margin = None
        if check_lossless:
            reference = greedy_generate(self.target, prompt_ids, max_new_tokens, self.stop_ids)
            mismatch = next((i for i, (a, b) in enumerate(zip(spec.tokens, reference)) if a != b),
                            None if len(spec.tokens) == len(reference) else min(len(spec.tokens), len(reference)))
            if mismatch is not None and mismatch < min(len(spec.tokens), len(reference)):
                margin = self._margin(prompt_ids + reference[:mismatch], reference[mismatch], spec.tokens[mismatch])
        return {
            "text": self.tokenizer.decode(spec.tokens),
            "tau": spec.tau,
            "passes": len(spec.committed),
            "committed": spec.committed,
            "new_tokens": len(spec.tokens),
            "lossless": mismatch is None if check_lossless else None,
            "first_mismatch": mismatch,
            "mismatch_margin": margin,
        }

    @torch.inference_mode()
    def _margin(self, prefix: list[int], greedy_token: int, spec_token: int) -> float:
        """How far apart the two picks at the first difference are: the target's logit of plain greedy's token minus
        that of the speculative token, after the shared prefix. Near zero (bf16 logits differ in their last bits
        between a block forward and a one-token step) is a near-tie flipped by rounding; large is a defect."""
        device = next(self.target.parameters()).device
        out, _ = _forward(self.target, torch.tensor([prefix], device=device), logits_to_keep=1)
        logits = out.logits[0, -1].float()  # [V]
        return float(logits[greedy_token] - logits[spec_token])


def evaluate_prompts(target_path: str, drafter_dir: str | Path, prompts: list[str | list[dict]],
                     max_new_tokens: int, device: str | torch.device = "cpu", lossless_prompts: int | None = None,
                     progress: bool = False) -> dict:
    """Every prompt through a PromptEvaluator: tau per prompt, mean tau, and whether the output equals plain greedy
    decoding; `lossless_prompts` checks only the first N prompts (the others report lossless None), None all.
    `progress`: a bar on stderr with the prompts done and the mean tau so far."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    evaluator = PromptEvaluator(target_path, drafter_dir, device)
    results = []
    columns = (TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"), TimeElapsedColumn(),
               TextColumn("{task.fields[tau]}"))
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("eval", total=len(prompts), tau="")
        for index, prompt in enumerate(prompts):
            results.append(evaluator.evaluate(prompt, max_new_tokens, lossless_prompts is None or index < lossless_prompts))
            bar.update(task, advance=1, tau=f"mean tau {sum(r['tau'] for r in results) / len(results):.3f}")
    return {
        "target": str(target_path),
        "drafter": str(drafter_dir),
        "max_new_tokens": max_new_tokens,
        "mean_tau": sum(r["tau"] for r in results) / len(results) if results else 0.0,
        "per_position_acceptance": per_position_acceptance((r["committed"] for r in results),
                                                           evaluator.drafter.config.block_size - 1),
        "lossless": all(r["lossless"] is not False for r in results),
        "lossless_checked": sum(r["lossless"] is not None for r in results),
        "prompts": results,
    }


@torch.no_grad()
def evaluate_blobs(drafter: DFlashDrafter, head: TargetHead, blobs: list[Blob], num_anchors: int,
                   seed: int = 0) -> dict:
    """Offline metrics over held-out blobs, one sample at a time with anchors drawn as in training (seeded):
    mean loss, per-slot accuracy acc_k (slots 1..B-1) and EAL from it, pooled over every valid slot."""
    cfg = drafter.config
    device = drafter.fc.weight.device
    generator = torch.Generator(device).manual_seed(seed)
    correct = torch.zeros(cfg.block_size - 1, dtype=torch.float64)  # [B-1]
    count = torch.zeros(cfg.block_size - 1, dtype=torch.float64)  # [B-1]
    loss_sum, samples = 0.0, 0
    for blob in blobs:
        if blob.layer_ids != list(cfg.target_layer_ids):
            raise ConfigError(
                f"blob {blob.chunk_id} holds layers {blob.layer_ids} but the drafter taps {cfg.target_layer_ids} "
                f"({CONVENTION}); evaluate with blobs extracted for this drafter."
            )
        for sample in blob.samples():
            batch = collate([sample], device)
            anchors, valid = sample_anchors(batch.loss_mask, num_anchors, generator)  # [1, N] x2
            if not valid.any():
                continue
            block_ids, targets, slot_valid = gather_blocks(batch.input_ids, batch.loss_mask, anchors, valid,
                                                           cfg.block_size, cfg.mask_token_id)  # [1, N, B] x3
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                hidden = drafter(batch.context, block_ids, anchors, head)  # [1, N, B, H]
            out = dflash_loss(hidden.to(head.lm_head.dtype), head.lm_head, targets, slot_valid)
            correct += out.correct.double().cpu()
            count += out.count.double().cpu()
            loss_sum += float(out.loss)
            samples += 1
    acc = correct / count.clamp_min(1)  # [B-1]
    return {
        "samples": samples,
        "loss": loss_sum / samples if samples else float("nan"),
        "acc": acc.tolist(),
        "eal": float(expected_acceptance_length(acc)),
        "slots": count.long().tolist(),
    }
