"""DFlash2's training side: the selector's objective (teacher forcing, unreachable slots left out, no gradient into
the backbone), the architecture as a setting, and a run that refuses to switch it. The computation against the
reference is tests/test_reference.py's; learning on a tiny target is tests/test_learning.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_drafter import FULL, make_drafter, micro_batch

from dflashq import settings as S
from dflashq.exceptions import ConfigError, ManifestMismatch
from dflashq.run import Run
from trainer.anchors import gather_blocks
from trainer.checkpoint import Saved, TrainState
from trainer.daemon import Trainer
from trainer.dflash2 import CandidateSelector, selector_loss
from trainer.loss import dflash_loss
from trainer.step import Batch, Blocks, backward
from trainer.target_head import TargetHead


def test_selector_loss_is_the_true_tokens_cross_entropy_after_the_true_predecessor_over_reachable_slots():
    torch.manual_seed(0)
    selector = CandidateSelector(hidden_size=8, vocab_size=20, rank=4, top_k=3)
    with torch.no_grad():
        selector.successor_codebook.weight.normal_()
    hidden, unary = torch.randn(4, 8), torch.randn(4, 3)  # [R, H], [R, K]
    candidates = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3]])  # [R, K]
    predecessor = torch.tensor([0, 1, 2, 3])  # [R]
    target = torch.tensor([2, 6, 11, 1])  # row 2's token is no candidate
    weight, slot = torch.tensor([1.0, 0.5, 1.0, 0.25]), torch.tensor([1, 2, 3, 1])  # [R] x2

    def loss_of(hidden, unary, predecessor):
        return selector_loss(selector, hidden, unary, candidates, predecessor, target, weight, slot, block_size=4)

    out = loss_of(hidden, unary, predecessor)
    scores = selector.scores(hidden, unary, candidates, predecessor)  # [R, K]
    cross_entropy = torch.nn.functional.cross_entropy(scores, torch.tensor([1, 2, 0, 0]), reduction="none")  # [R]
    reachable = torch.tensor([1.0, 1.0, 0.0, 1.0])
    expected = (cross_entropy * weight * reachable).sum() / (weight * reachable).sum()
    torch.testing.assert_close(out.loss, expected)
    assert out.reachable.tolist() == [2.0, 1.0, 0.0]  # slots 1, 2, 3
    picks = scores.argmax(-1)
    assert out.correct.tolist() == [float((picks[0] == 1) + (picks[3] == 0)), float(picks[1] == 2), 0.0]
    # the unreachable row does not count, whatever its states; the predecessor does
    edited_hidden, edited_unary = hidden.clone(), unary.clone()
    edited_hidden[2] += 5.0
    edited_unary[2] -= 3.0
    torch.testing.assert_close(loss_of(edited_hidden, edited_unary, predecessor).loss, out.loss)
    assert not torch.allclose(loss_of(hidden, unary, torch.tensor([7, 1, 2, 3])).loss, out.loss)


def test_dflash2_backbone_trains_on_dflashs_loss_alone_and_the_selector_on_its_own():
    drafter = make_drafter([FULL], "dflash2")
    head, batch, blocks = _step_inputs()
    out = backward(drafter, head, batch, blocks, loss_chunk_rows=16, attention="sdpa")
    both = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    drafter.zero_grad()
    hidden = drafter(batch.context, blocks.block_ids, blocks.anchors, head, "sdpa")
    dflash_loss(hidden, head.lm_head, blocks.targets, blocks.slot_valid, chunk_rows=16).loss.backward()
    for name, param in drafter.named_parameters():
        if name.startswith("candidate_selector."):
            assert param.grad is None and both[name].abs().sum() > 0, name  # trained by the selector's loss alone
        else:
            torch.testing.assert_close(both[name], param.grad, rtol=0, atol=0, msg=name)
    assert out.selector.reachable.sum() > 0 and out.selector.loss > 0
    assert (out.selector.reachable <= out.count).all() and (out.selector.correct <= out.selector.reachable).all()


def test_architecture_is_a_setting_from_the_environment():
    assert S.load(None, environ={}).train.architecture == "dflash"
    settings = S.load(None, environ={"DFLASHQ_TRAIN_ARCHITECTURE": "dflash2", "DFLASHQ_TRAIN_SELECTOR_RANK": "32"})
    assert (settings.train.architecture, settings.train.selector_rank, settings.train.selector_top_k) == ("dflash2", 32, 16)
    assert (settings.train.conv_kernel_size, settings.train.conv_group_size) == (2, 16)
    with pytest.raises(ConfigError, match="train.architecture"):
        S.load(None, environ={"DFLASHQ_TRAIN_ARCHITECTURE": "eagle3"})


def test_a_run_refuses_to_switch_its_architecture(tiny_qwen35, redis_url, tmp_path):
    values = {"run": "arch", "redis.url": redis_url, "store.path": str(tmp_path / "store"), "model.path": tiny_qwen35,
              "train.num_layers": 1, "train.selector_rank": 8}
    trainer = Trainer(Run.open(S.load(None, list(values.items()), environ={})), "cpu", progress=False)
    assert trainer.run.manifest["architecture"] == "dflash" and trainer.drafter.candidate_selector is None
    dflash2 = S.load(None, list({**values, "train.architecture": "dflash2"}.items()), environ={})
    with pytest.raises(ManifestMismatch, match="architecture = 'dflash' but this command has 'dflash2'"):
        Trainer(Run.open(dflash2), "cpu", progress=False)
    other = S.load(None, list({**values, "run": "arch2", "train.architecture": "dflash2"}.items()), environ={})
    trainer = Trainer(Run.open(other), "cpu", progress=False)
    assert trainer.run.manifest["architecture"] == "dflash2" and trainer.drafter.config.selector_rank == 8


def test_a_restart_refuses_a_checkpoint_of_the_other_architecture_or_other_dflash2_sizes():
    config = make_drafter([FULL]).config
    before = {k: v for k, v in dataclasses.asdict(config).items()
              if k not in ("architecture", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    saved = Saved("ckpt", before, TrainState(), {}, {}, {}, {})  # written before the architecture was a field
    saved.check_config(config)
    with pytest.raises(ConfigError, match="architecture = 'dflash' but the config now gives 'dflash2'"):
        saved.check_config(dataclasses.replace(config, architecture="dflash2"))
    dflash2 = dataclasses.replace(config, architecture="dflash2")
    with pytest.raises(ConfigError, match="selector_rank"):
        Saved("ckpt", dataclasses.asdict(dflash2), TrainState(), {}, {}, {}, {}).check_config(
            dataclasses.replace(dflash2, selector_rank=64))


def _two_rank_gradients(rank: int, parallel_mode: str, port: int, out: str) -> None:
    """One of two gloo ranks training the same micro-batch: the averaged gradient is one rank's, saved by rank 0."""
    import os

    import torch.distributed as dist

    from trainer.parallel import full_state, wrap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ranks = type("TwoRanks", (), {"distributed": True, "world_size": 2})()
        model = wrap(make_drafter([FULL, FULL], "dflash2"), ranks, parallel_mode, torch.device("cpu"))
        backward(model, *_step_inputs(), loss_chunk_rows=16, attention="sdpa")
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        before = {name: t.clone() for name, t in full_state(model, optimizer)[0].items()}  # (DDP: the live tensors)
        optimizer.step()  # weight - gradient: the full gradient, whatever the layout
        after = full_state(model, optimizer)[0]
        if rank == 0:
            torch.save({name: before[name] - after[name] for name in after}, out)
    finally:
        dist.destroy_process_group()


def _step_inputs() -> tuple[TargetHead, Batch, Blocks]:
    gen = torch.Generator().manual_seed(1)
    head = TargetHead(torch.randn(97, 64, generator=gen), torch.randn(97, 64, generator=gen))
    context, _, anchors, valid = micro_batch((21, 14, 9), 2)
    input_ids = torch.randint(0, 96, context.shape[:2], generator=gen)
    loss_mask = torch.ones(context.shape[:2], dtype=torch.uint8)
    return head, Batch(context, input_ids, loss_mask), Blocks(anchors, *gather_blocks(input_ids, loss_mask, anchors,
                                                                                        valid, 4, 96))


@pytest.mark.parametrize("parallel_mode", ["ddp", "fsdp"])
def test_ranks_train_the_selector_as_one_rank_does(parallel_mode, tmp_path):
    """The selector's loss is computed after the forward (trainer.step): under DDP and FSDP (trainer.parallel registers
    selector_loss as a forward method) two ranks still give every weight, the selector's included, one rank's
    gradient."""
    import socket

    import torch.multiprocessing as mp

    drafter = make_drafter([FULL, FULL], "dflash2")
    backward(drafter, *_step_inputs(), loss_chunk_rows=16, attention="sdpa")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "gradients.pt")
    mp.start_processes(_two_rank_gradients, args=(parallel_mode, port, out), nprocs=2, start_method="spawn")
    gradients = torch.load(out)
    assert set(gradients) == {name for name, _ in drafter.named_parameters()}
    for name, param in drafter.named_parameters():
        torch.testing.assert_close(gradients[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert gradients["candidate_selector.successor_codebook.weight"].abs().sum() > 0


@pytest.mark.slow
def test_the_selectors_chain_is_accepted_at_least_as_much_as_independent_argmaxes(tmp_path):
    """Point 2's measurement on a tiny learnable target (workers.tiny_model.make_learnable: after token x the Llama
    target emits x again): a DFlash2 drafter trained briefly (its slots are not all right yet, so the chain has
    something to fix or to spoil) drafts held-out prompts ending in tokens seen in training; its selector's chain
    must be accepted at least as much as the same drafter's independent argmaxes, both lossless."""
    from test_evaluate import make_drafter as drafter_for, overfit
    from test_learning import prompts

    from dflashq.target import load_target
    from trainer.evaluate import greedy_generate, speculative_generate, target_head
    from workers.tiny_model import make_learnable, write_tiny_model

    model_dir = make_learnable(write_tiny_model(str(tmp_path / "target"), "llama"))
    target = load_target(model_dir)
    head = target_head(target)
    # the 8 prompts whose last tokens end the held-out ones; at fewer steps the selector has seen too few rows whose
    # true token is a candidate, and which of the two chains wins depends on the machine's float rounding
    train = prompts(8, seed=0)
    drafter = overfit(drafter_for(model_dir, block_size=8, **{"architecture": "dflash2", "selector_rank": 16}), head,
                      target, [(ids, greedy_generate(target, ids, 12, set())) for ids in train], steps=14)
    held_out = [body + [train[i][-1]] for i, body in enumerate(prompts(8, seed=1))]
    references = [greedy_generate(target, ids, 16, set()) for ids in held_out]

    def taus() -> list[float]:
        results = [speculative_generate(target, drafter, head, ids, 16, set()) for ids in held_out]
        assert [r.tokens for r in results] == references  # lossless
        return [r.tau for r in results]

    chain = taus()
    selector, drafter.candidate_selector = drafter.candidate_selector, None  # the same drafter, each slot's argmax
    argmaxes = taus()
    print(f"held-out tau: selector chain {chain} (mean {sum(chain) / len(chain):.2f}), "
          f"independent argmaxes {argmaxes} (mean {sum(argmaxes) / len(argmaxes):.2f})")
    assert selector is not None and sum(chain) / len(chain) > 1.5, chain  # it learned
    assert sum(chain) >= sum(argmaxes), (chain, argmaxes)
