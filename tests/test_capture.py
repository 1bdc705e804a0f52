"""Target loading, hidden-state capture (batched, right-padded, early stop) and verification, on tiny random
qwen3_5 (hybrid, multimodal checkpoint), qwen3_next (hybrid MoE) and llama models."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflashq.blob import decode_blob, encode_blob
from dflashq.chunk import Sample
from dflashq.exceptions import ConfigError, InputError
from dflashq.chunk import micro_batches
from dflashq.capture import HiddenStateCapture, decoder_layers
from workers.capture import extract_samples, warm_up, warmup_shapes
from dflashq.target import load_target
from workers.tiny_model import ARCHS, VOCAB_SIZE, write_tiny_model
from workers.verify import verify_samples

# Around and across the 64-token chunks of the gated-delta-rule linear attention.
LENGTHS = [5, 63, 64, 65, 130, 200]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {arch: write_tiny_model(str(tmp_path_factory.mktemp(arch)), arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def models(model_dirs):
    return {arch: load_target(path) for arch, path in model_dirs.items()}


def _samples(lengths=LENGTHS, seed=0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 151643, n).astype(np.int32), np.ones(n, np.uint8), i) for i, n in enumerate(lengths)]


@torch.inference_mode()
def _output_hidden_states(model, sample: Sample, layer_ids) -> torch.Tensor:
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None]
    states = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.stack([states[t + 1][0] for t in layer_ids], dim=1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "llama"])
def test_padded_batch_capture_equals_output_hidden_states(models, arch):
    model = models[arch]
    last = len(decoder_layers(model)) - 1
    layer_ids = [last - 1, 0, 2]  # any order; the last layer is covered by the verify tests
    samples = _samples()
    assert micro_batches(LENGTHS, 10**6) == [[5, 4, 3, 2, 1, 0]]  # all six right-padded in one batch
    capture = HiddenStateCapture(model, layer_ids)
    try:
        batched = extract_samples(model, capture, samples, batch_tokens=10**6)
        split = extract_samples(model, capture, samples, batch_tokens=300)  # several micro-batches
    finally:
        capture.close()
    for sample, one, other in zip(samples, batched, split):
        reference = _output_hidden_states(model, sample, layer_ids)
        assert one.shape == (len(sample), 3, model.config.get_text_config().hidden_size)
        torch.testing.assert_close(one, reference, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(other, reference, rtol=1e-4, atol=1e-6)


def test_micro_batches_respect_the_padded_token_budget():
    batches = micro_batches([10, 300, 20, 30, 40], batch_tokens=90)
    assert batches == [[1], [4, 3], [2, 0]]  # longest first; rows x longest <= 90 unless a sample is alone


def test_forward_stops_after_the_deepest_tapped_layer(models):
    model = models["qwen3_5"]
    layers = decoder_layers(model)
    ran: list[str] = []
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(f"layer{i}"))
               for i, layer in enumerate(layers)]
    handles += [module.register_forward_pre_hook(lambda m, a, n=name: ran.append(n))
                for name, module in (("norm", model.model.norm), ("lm_head", model.lm_head))]
    capture = HiddenStateCapture(model, [3, 1])
    try:
        hidden = capture.capture(torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.long))
        assert hidden.shape == (1, 4, 2, 64)
        assert ran == ["layer0", "layer1", "layer2", "layer3"]
        capture.close()
        ran.clear()
        with torch.inference_mode():
            model(input_ids=torch.tensor([[1, 2]]))  # capture hooks removed: the model runs whole again
        assert ran[-2:] == ["norm", "lm_head"] and len(ran) == len(layers) + 2
    finally:
        capture.close()
        for handle in handles:
            handle.remove()


def test_layer_ids_outside_the_model_are_refused(models):
    with pytest.raises(ConfigError, match="within the target's 6 decoder layers"):
        HiddenStateCapture(models["llama"], [1, 6])


def test_multimodal_checkpoint_loads_its_language_model_only(models, model_dirs):
    model = models["qwen3_5"]
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.dtype == torch.float32
    assert not any("visual" in name for name in model.state_dict())
    saved = load_file(f"{model_dirs['qwen3_5']}/model.safetensors")
    assert any(name.startswith("model.visual.") for name in saved)
    assert torch.equal(model.model.layers[0].linear_attn.in_proj_qkv.weight,
                       saved["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])
    assert [type(layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn).__name__
            for layer in model.model.layers][2:4] == ["Qwen3_5GatedDeltaNet", "Qwen3_5Attention"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the guard only acts without an accelerator")
def test_linear_attention_kernels_are_blocked_on_cpu(models):
    assert "fla" in sys.modules and sys.modules["fla"] is None


def test_bad_model_folders_raise_input_error(tmp_path):
    with pytest.raises(InputError, match="no config.json"):
        load_target(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InputError, match="cannot load the target model"):
        load_target(str(tmp_path))  # no safetensors weights


def test_tiny_models_are_deterministic_by_seed(tmp_path):
    first = load_file(write_tiny_model(str(tmp_path / "a"), "qwen3_next", seed=3) + "/model.safetensors")
    second = load_file(write_tiny_model(str(tmp_path / "b"), "qwen3_next", seed=3) + "/model.safetensors")
    other = load_file(write_tiny_model(str(tmp_path / "c"), "qwen3_next", seed=4) + "/model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


@pytest.mark.slow
def test_tiny_model_tokenizers_and_chat_templates(model_dirs):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    qwen = AutoTokenizer.from_pretrained(model_dirs["qwen3_5"]).apply_chat_template(messages, tokenize=False)
    llama = AutoTokenizer.from_pretrained(model_dirs["llama"]).apply_chat_template(messages, tokenize=False)
    assert qwen.startswith("<|im_start|>user\nhi<|im_end|>")
    assert llama.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    assert len(AutoTokenizer.from_pretrained(model_dirs["llama"])) <= VOCAB_SIZE  # every token has an embedding row


def _stored(model, layer_ids, samples):
    """Extract in padded batches and round-trip through a blob, as the worker and trainer would."""
    capture = HiddenStateCapture(model, layer_ids)
    try:
        hidden = extract_samples(model, capture, samples, batch_tokens=400)
    finally:
        capture.close()
    ids = np.concatenate([s.input_ids for s in samples])
    offsets = np.cumsum([0, *(len(s) for s in samples)])
    data = encode_blob(torch.cat(hidden), ids, np.ones_like(ids, np.uint8), offsets,
                       {"run": "t", "chunk_id": "c", "epoch": 0, "layer_ids": layer_ids})
    return [h.clone() for h, _, _ in decode_blob(b"".join(data)).samples()]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_verify_passes_correct_states_including_the_last_layer(models, arch):
    model = models[arch]
    layer_ids = [0, len(decoder_layers(model)) - 1]  # the last layer's raw output, not the final-normed one
    samples = _samples([65, 130, 5])
    reports, ok = verify_samples(model, layer_ids, samples, _stored(model, layer_ids, samples))
    assert ok and [r.layer_id for r in reports] == layer_ids
    assert all(r.max_rel_diff < 1e-5 and r.problems() == "ok" for r in reports)


@pytest.mark.slow
def test_verify_flags_zeroed_and_perturbed_layers(models):
    model = models["qwen3_5"]
    layer_ids = [1, 4, 7]
    samples = _samples([64, 100])
    stored = _stored(model, layer_ids, samples)
    stored[1][:, 0] = 0  # layer 1 all zero in one sample
    stored[0][10:12, 2] += 0.05 * stored[0][:, 2].abs().max()  # layer 7 perturbed by 5% of its range
    reports, ok = verify_samples(model, layer_ids, samples, stored)
    assert not ok
    zeroed, clean, perturbed = reports
    assert zeroed.all_zero_samples == 1 and zeroed.mismatched_samples == 1 and not zeroed.ok
    assert clean.ok and clean.max_abs_diff < 1e-6
    assert perturbed.mismatched_samples == 1 and 0.04 < perturbed.max_rel_diff < 0.06
    assert "mismatched" in perturbed.problems()


def test_verify_flags_non_finite_values(models):
    model = models["llama"]
    samples = _samples([9])
    stored = _stored(model, [2], samples)
    stored[0][3, 0, 5] = float("inf")
    (report,), ok = verify_samples(model, [2], samples, stored)
    assert not ok and report.non_finite == 1


@pytest.mark.slow
def test_verify_tolerates_bf16_batching_noise(model_dirs):
    model = load_target(model_dirs["qwen3_5"], dtype="bfloat16")
    layer_ids = [2, 5, 7]
    samples = _samples([5, 63, 130])
    reports, ok = verify_samples(model, layer_ids, samples, _stored(model, layer_ids, samples))
    assert ok, [(r.layer_id, r.max_rel_diff) for r in reports]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_warm_up_runs_every_shape_through_the_first_layer_of_each_kind(models, arch):
    """Every power-of-two row count and a token total in every 512-token step, through layers 0..3 of the hybrid
    model (3 linear-attention layers, then the first full-attention one) or layer 0 of Llama; no hook left behind."""
    model = models[arch]
    layers = decoder_layers(model)
    hooks_before = [dict(layer._forward_hooks) for layer in layers]
    shapes: list[tuple[int, ...]] = []
    ran: list[int] = []
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    handles.append(model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                   with_kwargs=True))
    try:
        assert warm_up(model, 2048) == len(warmup_shapes(2048)) == len(shapes)
    finally:
        for handle in handles:
            handle.remove()
    assert shapes == [(1, 64), (2, 64), (4, 64), (8, 64), (16, 64), (32, 64), (1, 512), (1, 1024), (1, 1536), (1, 2048)]
    deepest = 3 if arch == "qwen3_5" else 0
    assert ran == list(range(deepest + 1)) * len(shapes)
    assert [dict(layer._forward_hooks) for layer in layers] == hooks_before


def test_fused_kernels_leave_the_per_head_norms_to_transformers(models):
    """fla's norm would autotune for nearly every batch size on the q/k norms (tokens x heads rows)."""
    from workers.fused_kernels import ZERO_CENTRED_NORMS, _replaceable

    model = models["qwen3_5"]
    hidden = model.config.get_text_config().hidden_size
    norms = {name for name, m in model.named_modules() if type(m).__name__ in ZERO_CENTRED_NORMS}
    replaced = {name for name, m in model.named_modules() if type(m).__name__ in ZERO_CENTRED_NORMS and _replaceable(m, hidden)}
    assert {n for n in norms if n.endswith(("q_norm", "k_norm"))} == norms - replaced != set()
    assert {"model.norm", "model.layers.0.input_layernorm", "model.layers.3.post_attention_layernorm"} <= replaced
