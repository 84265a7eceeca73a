"""A decoder layer's parts in one C call (kernels/cpu_layer_decode.c) compute what its modules
compute, bit for bit: the same greedy tokens and log-probabilities as the engine without them, at
float32 and through the low-bit panels (int8 inputs too), with several sequences decoding together and prefill
chunks beside them, on each ISA variant this CPU runs. Qwen3.5's linear-attention layers and the
decoder layers of Qwen2.5-VL (q/k/v biases, M-RoPE) and Qwen3-VL (q/k norms, DeepStack) decode
whole in one call, every layer's post-attention half runs in one (Qwen3.5's gated full-attention
layers too); a part it cannot describe keeps its modules."""

from __future__ import annotations

import pytest

from helpers.families import assert_all_free, engine, family_prompt, mm
from helpers.images import make_image
from mm_engine import SamplingParams
from mm_engine.kernels import cpu_build, cpu_layer_decode, cpu_qgemm_a8
from mm_engine.kernels.cpu_kernels import KERNELS

pytestmark = pytest.mark.slow

WITHOUT = ",".join(k for k in KERNELS if k != "layer_decode")
QUESTIONS = [
    "what is this",
    "how many shapes are there",
    "which is left and which is right of the two",
    "describe it",
]
IMAGES = {0: [make_image(1, (70, 45))], 3: [make_image(4, (40, 90))]}


def _run(path: str, family: str, variant: str, kernels: str, quantization: str | None):
    llm = engine(path, "cpu", cpu_kernel_variant=variant, cpu_kernels=kernels, quantization=quantization,
                 max_num_batched_tokens=64)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=9, logprobs=0, ignore_eos=True)
    prompts = [
        mm(family_prompt(family, q, len(IMAGES.get(i, []))), IMAGES.get(i, []))
        for i, q in enumerate(QUESTIONS)
    ]
    outs = llm.generate(prompts, params)
    layers = llm.engine.core.model.language_model.layers
    specs = {
        "whole": [layer.decode_spec is not None for layer in layers if getattr(layer, "linear", True)],
        "mlp": [layer.mlp_spec is not None for layer in layers],
    }
    got = [
        (list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
        for o in outs
    ]
    assert_all_free(llm)
    return got, specs


def _counting(monkeypatch, name: str, rows_arg: int) -> list[int]:
    """Rows of each call of cpu_layer_decode's `name`, which still runs."""
    calls: list[int] = []
    run = getattr(cpu_layer_decode, name)
    monkeypatch.setattr(cpu_layer_decode, name, lambda *a: calls.append(a[rows_arg].shape[0]) or run(*a))
    return calls


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "w8a8", "w4a8"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen2_5_vl", "qwen3_vl"])
def test_one_call_parts_equal_the_modules_bit_for_bit(
    vl_family, cpu_variant, family, quantization, monkeypatch
):
    kind = {"w8a8": "int8", "w4a8": "int4"}.get(quantization)
    if kind is not None and not cpu_qgemm_a8.available(cpu_build.load(cpu_variant), kind):
        # (such layers keep their fake-quantized modules: test_a_part_it_cannot_describe_keeps_its_modules)
        pytest.skip(f"the {cpu_variant} build has no int8-input kernel for {kind} weights: no one-call form")
    path, _ = vl_family(family)
    name = "delta_layer_decode" if family == "qwen3_5" else "attn_layer_decode"
    whole, halves = _counting(monkeypatch, name, 2), _counting(monkeypatch, "mlp_decode", 2)
    fused, specs = _run(path, family, cpu_variant, "all", quantization)
    assert all(specs["mlp"]) and all(specs["whole"]) and specs["mlp"] and specs["whole"]
    assert max(whole) == len(QUESTIONS)  # every sequence decoding in one call
    assert max(halves) > len(QUESTIONS)  # a prefill chunk's rows through the MLP half
    whole.clear(), halves.clear()
    modules, specs = _run(path, family, cpu_variant, WITHOUT, quantization)
    assert not any(specs["whole"] + specs["mlp"]) and not whole and not halves
    assert fused == modules  # tokens and log-probabilities, exactly


def test_a_part_it_cannot_describe_keeps_its_modules(vl_family):
    path, _ = vl_family("qwen3_5")
    # int8 inputs (the integer kernel, or fake quantization where the CPU has none for the kind)
    got, specs = _run(path, "qwen3_5", "portable", "all", "w8a8")
    assert specs["whole"] and not any(specs["whole"] + specs["mlp"])
    assert all(len(tokens) == 9 for tokens, _ in got)
