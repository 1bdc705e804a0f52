"""Anchor sampling, block gathering and the chunked decay-weighted loss with its accuracy and EAL metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.anchors import gather_blocks, sample_anchors
from trainer.drafter import DFlashDrafter, DrafterConfig
from trainer.loss import decay_weights, default_gamma, dflash_loss, expected_acceptance_length
from trainer.step import Batch, Blocks, backward, collate, draw_blocks, loss_shares
from trainer.target_head import TargetHead


def test_anchors_are_sorted_distinct_supervised_pairs_padded_at_the_end():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1],
                              [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    candidates = [{1, 2, 5, 10}, {2}]  # p with mask[p] and mask[p+1]; the last position never qualifies
    for seed in range(20):
        anchors, valid = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(seed))
        assert anchors.shape == (2, 3)
        for row in range(2):
            chosen = anchors[row][valid[row]].tolist()
            assert len(chosen) == min(3, len(candidates[row])) and set(chosen) <= candidates[row]
            assert chosen == sorted(set(chosen))
            assert valid[row].tolist() == sorted(valid[row].tolist(), reverse=True)  # padding only at the end
            assert (anchors[row][~valid[row]] == 0).all()


def test_anchor_columns_shrink_to_the_most_candidates_in_the_batch():
    anchors, valid = sample_anchors(torch.tensor([[1, 1, 1, 0, 0, 0]]), 512)
    assert anchors.tolist() == [[0, 1]] and valid.all()


def test_exact_anchor_count_pads_with_invalid_anchors_and_draws_the_same_valid_ones():
    # compiled flex training keeps the query length (anchors x block) a constant of the kernel
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1],
                              [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    for seed in range(10):
        shrunk = sample_anchors(loss_mask, 20, torch.Generator().manual_seed(seed))
        exact = sample_anchors(loss_mask, 20, torch.Generator().manual_seed(seed), exact=True)
        assert shrunk[0].shape == (2, 4) and exact[0].shape == (2, 20)  # 20 > the 12 positions of a row
        for row in range(2):
            assert exact[0][row][exact[1][row]].tolist() == shrunk[0][row][shrunk[1][row]].tolist()
        assert exact[1].sum() == shrunk[1].sum() == 5 and (exact[0][~exact[1]] == 0).all()


def test_anchor_sampling_is_reproducible_and_uniform():
    loss_mask = torch.ones(4000, 11, dtype=torch.long)  # 10 candidates per row
    first, _ = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(7))
    again, _ = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(7))
    other, _ = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)
    counts = torch.bincount(first.flatten(), minlength=10).float()  # expected 1200 each
    assert (counts - 1200).abs().max() < 150


def test_gather_blocks_builds_inputs_targets_and_valid_slots():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1]])
    anchors, valid = torch.tensor([[1, 5, 0]]), torch.tensor([[True, True, False]])
    block_ids, targets, slot_valid = gather_blocks(input_ids, loss_mask, anchors, valid, 4, 99)
    assert block_ids.tolist() == [[[11, 99, 99, 99], [15, 99, 99, 99], [10, 99, 99, 99]]]
    assert targets[0, 0].tolist() == [11, 12, 13, 14]
    # slot 0 never; a_j + k past the end never; unsupervised position 4 never; padded block never.
    assert slot_valid.tolist() == [[[False, True, True, False], [False, True, False, False], [False] * 4]]


def test_decay_weights_follow_the_published_gammas():
    assert default_gamma(16) == 7 and default_gamma(8) == 4
    weights = decay_weights(16)
    assert weights[0] == 0 and weights[1] == 1
    assert weights[8].item() == pytest.approx(math.exp(-1))  # k - 1 == gamma
    assert decay_weights(8)[5].item() == pytest.approx(math.exp(-1))


def make_loss_inputs(seed=0, batch=2, blocks=5, block=6, hidden=16, vocab=50):
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(batch, blocks, block, hidden, generator=gen, requires_grad=True)
    lm_head = torch.randn(vocab, hidden, generator=gen)
    targets = torch.randint(0, vocab, (batch, blocks, block), generator=gen)
    slot_valid = torch.rand(batch, blocks, block, generator=gen) < 0.7
    slot_valid[..., 0] = False
    return states, lm_head, targets, slot_valid


def reference_loss(states, lm_head, targets, slot_valid):
    weights = decay_weights(states.shape[2]).expand_as(slot_valid)
    ce = F.cross_entropy((states @ lm_head.T).flatten(0, 2), targets.flatten(), reduction="none").view_as(weights)
    return (ce * weights * slot_valid).sum() / (weights * slot_valid).sum()


@pytest.mark.parametrize("chunk_rows", [1, 7, 10_000])
def test_chunked_loss_equals_the_full_logits_loss_and_gradient(chunk_rows):
    states, lm_head, targets, slot_valid = make_loss_inputs()
    expected = reference_loss(states, lm_head, targets, slot_valid)
    (expected_grad,) = torch.autograd.grad(expected, states)
    result = dflash_loss(states, lm_head, targets, slot_valid, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad(2.0 * result.loss, states)  # a non-unit upstream gradient must scale
    torch.testing.assert_close(result.loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, 2.0 * expected_grad, atol=1e-6, rtol=1e-5)
    assert (grad[~slot_valid] == 0).all()


def test_per_slot_accuracy_counts_only_valid_slots():
    states, lm_head, targets, slot_valid = make_loss_inputs(seed=1)
    predicted = (states @ lm_head.T).argmax(-1)
    targets = torch.where(torch.rand(targets.shape) < 0.5, predicted, targets)  # make about half correct
    result = dflash_loss(states, lm_head, targets, slot_valid, chunk_rows=4)
    hits = (predicted == targets) & slot_valid
    expected = hits.sum((0, 1))[1:] / slot_valid.sum((0, 1))[1:]
    torch.testing.assert_close(result.acc, expected.float())
    torch.testing.assert_close(result.eal, expected_acceptance_length(expected.float()))
    assert 0 < result.acc.mean() < 1


def test_expected_acceptance_length_formula():
    assert expected_acceptance_length(torch.tensor([1.0, 0.5, 0.5, 0.0])).item() == pytest.approx(2.75)
    assert expected_acceptance_length(torch.ones(15)).item() == 16


def test_a_batch_without_valid_slots_gives_zero_loss_and_zero_gradient():
    states, lm_head, targets, slot_valid = make_loss_inputs()
    result = dflash_loss(states, lm_head, targets, torch.zeros_like(slot_valid))
    result.loss.backward()
    assert result.loss.item() == 0 and (states.grad == 0).all() and result.eal.item() == 1


def test_a_trainable_lm_head_is_refused():
    states, lm_head, targets, slot_valid = make_loss_inputs()
    with pytest.raises(ValueError, match="frozen"):
        dflash_loss(states, lm_head.requires_grad_(), targets, slot_valid)


def test_a_chunk_split_into_micro_batches_trains_as_one_batch():
    """Weighed by their shares of the chunk's blocks (trainer.step.loss_shares), the micro-batches' losses and
    gradients add up to those of the chunk as one batch; their plain mean, which the trainer took before, does not."""
    target = {"hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 61, "intermediate_size": 48,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    config = DrafterConfig.default_for_target(target, num_layers=1, layer_ids=[1], mask_token_id=60, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    gen = torch.Generator().manual_seed(3)
    head = TargetHead(torch.randn(61, 32, generator=gen), torch.randn(61, 32, generator=gen))
    lengths = [40, 9, 6]  # one long sample and two short ones, as a chunk's first and last micro-batches hold
    samples = [(torch.randn(n, 1, 32, generator=gen), torch.randint(0, 60, (n,), generator=gen),
                (torch.arange(n) >= 2).to(torch.uint8)) for n in lengths]
    whole = collate(samples, "cpu")
    drawn = draw_blocks(config, whole, 12, torch.Generator().manual_seed(5), "sdpa")

    def gradients(parts: list[tuple[Batch, Blocks]], shares) -> tuple[float, list[torch.Tensor]]:
        drafter.zero_grad()
        loss = 0.0
        for (batch, blocks), share in zip(parts, shares):
            loss += float(share) * float(backward(drafter, head, batch, blocks, loss_chunk_rows=64,
                                                  scale=share, attention="sdpa").loss.detach())
        return loss, [p.grad.clone() for p in drafter.parameters()]

    one_loss, one_grads = gradients([(whole, drawn)], [1.0])
    rows = [(collate([sample], "cpu"),  # each sample a micro-batch of its own, with the blocks drawn for it above
             Blocks(*(t[i:i + 1] for t in (drawn.anchors, drawn.block_ids, drawn.targets, drawn.slot_valid))))
            for i, sample in enumerate(samples)]
    shares = loss_shares([blocks for _, blocks in rows])
    split_loss, split_grads = gradients(rows, shares)
    assert split_loss == pytest.approx(one_loss, rel=1e-5)
    for split, one in zip(split_grads, one_grads):
        torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-4)
    assert shares[0] > 0.6  # the long sample holds most of the chunk's blocks
    _, mean_grads = gradients(rows, [1 / 3] * 3)
    assert not all(torch.allclose(mean, one, atol=1e-6, rtol=1e-2) for mean, one in zip(mean_grads, one_grads))
