"""`quantization` on load (models/layers/quant_linear.py) and checkpoints stored quantized
(models/checkpoint_quant.py): the engine gives transformers' greedy tokens when transformers runs
the same checkpoint with its linears at the dequantized weights, on the cpu backend (the low-bit
GEMM), the torch backend (the dequantizing reference) and Triton (its low-bit GEMM), in mixed
batches with images; the vision tower and the LM head stay as they were unless asked; a setting or
a stored format the engine does not take is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.families import assert_all_free, engine, family_prompt, greedy, mm, run_batch_against
from helpers.fp8 import fp8_checkpoint
from helpers.images import make_image
from helpers.reference import FamilyReference
from mm_engine import LLM
from mm_engine.models.layers.act_quant import fake_quantize
from mm_engine.models.layers.quant_linear import INT8_INPUTS, QuantLinear, quantize


def cases(family: str) -> list:
    return [
        (family_prompt(family, "what is this", 1), [make_image(1, (70, 45))], 8),
        (family_prompt(family, "which is left", 2), [make_image(2, (120, 100)), make_image(3, (30, 64))], 6),
        (family_prompt(family, "how many shapes are there", 0), [], 8),
    ]


def quantized_reference(path: str, kind: str, head: bool = False) -> FamilyReference:
    """transformers with every linear layer of the language model (the head too with `head`)
    replaced by its dequantized `kind` weight: what the engine computes, summed in another order.
    w8a8, w4a8: those layers' inputs fake-quantized to int8 per token too, as compressed-tensors
    runs a W8A8 checkpoint (act_quant.py, pinned to the library below)."""
    ref = FamilyReference(path)
    lm = ref.model.model.language_model
    with torch.no_grad():
        for module in lm.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(quantize(module.weight, kind).dequantize())
                if kind in INT8_INPUTS:
                    module.register_forward_pre_hook(lambda _, args: (fake_quantize(args[0], "int8"),))
        if head:  # a new tensor: a head tied to the embeddings leaves them as they are
            ref.model.lm_head.weight = nn.Parameter(quantize(ref.model.lm_head.weight, kind).dequantize())
    return ref


@pytest.fixture(scope="module")
def references(vl_family):
    built = {}

    def get(family: str, kind: str):
        if (family, kind) not in built:
            path, _ = vl_family(family)
            built[family, kind] = (path, quantized_reference(path, kind))
        return built[family, kind]

    return get


@pytest.mark.parametrize(
    ("family", "kind", "backend"),
    [
        ("qwen3_5", "int4", "cpu"),
        ("qwen3_5", "int8", "cpu"),
        ("qwen3_5", "fp8", "cpu"),
        ("qwen3_5", "bf16", "cpu"),
        ("qwen3_5", "int4", "torch"),
        ("qwen2_vl", "int4", "cpu"),  # biases on q, k and v
        ("qwen2_vl", "int8", "torch"),
        ("qwen3_5", "w4a8", "cpu"),  # int8 inputs: the VNNI kernel where the CPU has it
        ("qwen2_vl", "w8a8", "cpu"),
        ("qwen2_vl", "w8a8", "torch"),
    ],
)
def test_quantized_tokens_equal_transformers_on_the_dequantized_weights(
    vl_family, references, family, kind, backend
):
    path, ref = references(family, kind)
    if kind in INT8_INPUTS:  # a sum's last bits can step an input over the int8 grid: near ties
        llm = engine(path, backend, quantization=kind)
        batch = cases(family)
        outs = llm.generate([mm(p, imgs) for p, imgs, _ in batch], [greedy(n) for *_, n in batch])
        for out, (text, imgs, n) in zip(outs, batch, strict=True):
            assert_equal_but_near_ties(ref, text, imgs, n, out.outputs[0].token_ids)
        assert_all_free(llm)
        return
    outs = run_batch_against(ref, path, backend, cases(family), quantization=kind)
    if kind == "int4":  # the rounding shows: the full-precision model says something else
        _, full = vl_family(family)
        plain = [full.generate(text, imgs, n) for text, imgs, n in cases(family)]
        assert [o.outputs[0].token_ids for o in outs] != plain


def test_only_the_language_models_linears_are_quantized_and_the_platform_says_how(vl_family):
    path, _ = vl_family("qwen2_vl")
    llm = LLM(path, attention_backend="cpu", quantization="int4", kv_cache_memory_bytes=4 * 1024**2)
    model = llm.engine.core.model
    lm = model.language_model
    quantized = [m for m in lm.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(m.panels is not None and m.kind == "int4" for m in quantized)  # the C kernel
    assert not isinstance(lm.lm_head, QuantLinear)
    assert not any(isinstance(m, QuantLinear) for m in model.visual.modules())
    info = llm.engine.core.platform.info()
    assert info["quantization"] == "int4" and info["quantized_compute"].startswith("qgemm-")


def test_int8_inputs_take_the_integer_kernel_where_the_cpu_has_it(vl_family):
    from mm_engine.kernels import cpu_qgemm_a8

    path, _ = vl_family("qwen2_vl")
    llm = LLM(path, attention_backend="cpu", quantization="w4a8", kv_cache_memory_bytes=4 * 1024**2)
    core = llm.engine.core
    layers = [m for m in core.model.language_model.modules() if isinstance(m, QuantLinear)]
    vnni = cpu_qgemm_a8.available(core.platform.qgemm_lib(), "int4")  # avx512 + VNNI, or avx2
    assert layers and all(m.kind == "int4" and m.act == "int8" for m in layers)
    assert all((m.a8 is not None) == vnni and (m.panels is None) == vnni for m in layers)
    assert core.platform.info()["quantized_compute"].endswith("-int8-inputs") == vnni


def test_a_bad_quantization_is_refused_by_name(vl_family):
    path, _ = vl_family("qwen2_vl")
    with pytest.raises(ValueError, match="quantization must be one of .*'int3'"):
        LLM(path, quantization="int3")


def test_the_head_is_quantized_when_asked(vl_family):
    path, _ = vl_family("qwen3_5")
    ref = quantized_reference(path, "int8", head=True)
    outs = run_batch_against(ref, path, "cpu", cases("qwen3_5"), quantization="int8", quantize_lm_head=True)
    assert len(outs) == 3
    llm = LLM(path, attention_backend="cpu", quantization="int8", quantize_lm_head=True)
    assert isinstance(llm.engine.core.model.language_model.lm_head, QuantLinear)
    assert llm.engine.core.platform.info()["quantized_lm_head"]


@pytest.mark.parametrize(
    ("quant", "refusal"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'\\), which this engine"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ bits=3 is not loaded"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "GPTQ format 'marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version='gemv' is not loaded"),
        ({"quant_method": "compressed-tensors"}, "config without config_groups is not loaded"),
        ({"quant_method": "fp8"}, "FP8 layout \\(weight_block_size=None.*not one"),  # per-tensor
    ],
)
def test_a_checkpoint_stored_quantized_is_refused_by_its_method(vl_family, tmp_path, quant, refusal):
    import json
    import shutil

    path, _ = vl_family("qwen2_vl")
    copy = shutil.copytree(path, tmp_path / "quantized")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = quant
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=refusal):
        LLM(str(copy))


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8", "bf16"])
def test_a_stored_weight_cut_by_rows_or_inputs_keeps_each_values_scale(kind):
    """A tensor-parallel share of a stored weight (parallel/shard_stored.py) stands for the same
    part of the same float weight: input ranges that cut a group take narrower groups, and the
    vocabulary's padding rows are zero."""
    whole = quantize(torch.randn(24, 96, generator=torch.Generator().manual_seed(1)), kind, 32)
    if kind == "int4":  # asymmetric: a zero point per group
        whole.zeros = torch.randint(
            0, 16, whole.scales.shape, generator=torch.Generator().manual_seed(2)
        ).float()
    dense = whole.dequantize()
    for start, end in ((0, 48), (48, 96), (16, 40)):  # the last: groups of gcd(24, 32) = 8
        assert torch.equal(whole.columns(start, end).dequantize(), dense[:, start:end])
    assert torch.equal(whole.rows(5, 17).dequantize(), dense[5:17])
    padded = whole.rows(20, 24).padded_rows(8).dequantize()
    assert torch.equal(padded[:4], dense[20:]) and not padded[4:].any()
    whole.perm = torch.randperm(96, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="act-order"):
        whole.columns(0, 48)


@pytest.mark.parametrize(
    ("family", "backend"), [("qwen3_5", "cpu"), ("qwen2_vl", "cpu"), ("qwen2_vl", "torch")]
)
def test_an_fp8_checkpoint_loads_as_stored_and_equals_its_dequantized_twin(
    vl_family, tmp_path, family, backend
):
    path, _ = vl_family(family)
    fp8, twin = fp8_checkpoint(path, tmp_path)
    outs = run_batch_against(FamilyReference(twin), fp8, backend, cases(family))
    assert len(outs) == 3
    llm = LLM(fp8, attention_backend=backend, kv_cache_memory_bytes=4 * 1024**2)
    stored = [m for m in llm.engine.core.model.language_model.modules() if isinstance(m, QuantLinear)]
    assert stored and all(m.kind == "fp8" for m in stored)  # read as stored, nothing rounded again
    assert (stored[0].panels is not None) == (backend == "cpu")


INT4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}
FP8 = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
INT8 = {"type": "int", "num_bits": 8, "symmetric": True, "dynamic": False}


@pytest.mark.parametrize(
    ("group", "refusal"),
    [
        ({"format": "nvfp4-pack-quantized", "weights": {**FP8, "num_bits": 4}}, "format='nvfp4-pack"),
        ({"weights": {**INT4, "actorder": "group"}}, "actorder='group'"),
        ({"weights": INT4, "input_activations": {"num_bits": 8}}, "input_activations="),
        (
            {"format": "float-quantized", "weights": {**FP8, "strategy": "channel"},
             "input_activations": {**FP8, "dynamic": True, "strategy": "group", "group_size": 128}},
            "input_activations.strategy='group'",
        ),
        (
            {"format": "int-quantized", "weights": {**INT8, "strategy": "channel"},
             "input_activations": {**INT8, "dynamic": True, "strategy": "token", "symmetric": False}},
            "input_activations.symmetric=False",
        ),
        ({"format": "int-quantized", "weights": {**INT8, "symmetric": False}}, "symmetric=False"),
    ],
)  # fmt: skip
def test_compressed_tensors_options_not_loaded_are_refused_by_name(vl_family, tmp_path, group, refusal):
    """(One config group; several with different formats or input schemes are refused too.)"""
    import json
    import shutil

    path, _ = vl_family("qwen2_vl")
    copy = shutil.copytree(path, tmp_path / "ct")
    config = json.loads((copy / "config.json").read_text())
    groups = {"group_0": group}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups}
    (copy / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError, match=refusal):
        LLM(str(copy))


@pytest.mark.parametrize(
    ("family", "bits", "group", "symmetric", "backend"),
    [
        ("qwen3_5", 4, 32, True, "cpu"),
        ("qwen3_5", 4, 32, False, "cpu"),  # zero points, packed down the rows (4 rows: one word)
        ("qwen2_vl", 8, None, True, "cpu"),  # per channel
        ("qwen2_vl", 4, None, False, "torch"),
        ("qwen2_vl", 4, 32, True, "triton"),
    ],
)
def test_a_pack_quantized_checkpoint_written_by_compressed_tensors_equals_its_decompressed_twin(
    vl_family, tmp_path, family, bits, group, symmetric, backend
):
    from helpers.compressed import dequantized_twin, pack_quantized_checkpoint

    path, _ = vl_family(family)
    packed, twin = tmp_path / "packed", tmp_path / "twin"
    pack_quantized_checkpoint(path, packed, bits, group, symmetric)
    dequantized_twin(packed, twin)
    outs = run_batch_against(FamilyReference(str(twin)), str(packed), backend, cases(family))
    assert len(outs) == 3
    llm = LLM(str(packed), attention_backend=backend, kv_cache_memory_bytes=4 * 1024**2)
    stored = [m for m in llm.engine.core.model.language_model.modules() if isinstance(m, QuantLinear)]
    assert stored and {m.kind for m in stored} == {f"int{bits}"}
    assert all((m.weight_q if m.panels is None else m.panels).zeros is None for m in stored) == symmetric


def gptq_per_element(t: dict, bits: int) -> torch.Tensor:
    """GPTQ v1 tensors read one weight at a time, as its format documents them: input k is bits
    (k mod 32/bits) x bits of qweight[k // (32/bits), n]; its zero point, bits of qzeros[g, n //
    (32/bits)], plus one; w[n, k] = (q - zero) x scale[g, n], g = g_idx[k]."""
    per, mask = 32 // bits, 2**bits - 1
    qweight, qzeros, scales, g_idx = (t[name].tolist() for name in ("qweight", "qzeros", "scales", "g_idx"))
    w = torch.empty(len(qweight[0]), len(qweight) * per)
    for k in range(w.shape[1]):
        g = g_idx[k]
        for n in range(w.shape[0]):
            q = (qweight[k // per][n] >> (bits * (k % per))) & mask
            zero = ((qzeros[g][n // per] >> (bits * (n % per))) & mask) + 1
            w[n, k] = (q - zero) * scales[g][n]
    return w


def awq_per_element(t: dict, group: int) -> torch.Tensor:
    """AWQ tensors read one weight at a time: output n is nibble AWQ_ORDER.index(n mod 8) of the
    word n // 8 of its row (qweight's row k, qzeros' row k // group)."""
    from helpers.gptq_awq import AWQ_ORDER

    qweight, qzeros, scales = (t[name].tolist() for name in ("qweight", "qzeros", "scales"))
    w = torch.empty(len(qweight[0]) * 8, len(qweight))
    for k in range(w.shape[1]):
        for n in range(w.shape[0]):
            shift = 4 * AWQ_ORDER.index(n % 8)
            q, zero = (qweight[k][n // 8] >> shift) & 15, (qzeros[k // group][n // 8] >> shift) & 15
            w[n, k] = (q - zero) * scales[k // group][n]
    return w


@pytest.mark.parametrize(
    ("bits", "group", "symmetric", "act_order"),
    [(4, 16, False, True), (4, -1, True, False), (8, 16, True, True), (4, 16, True, True)],
)
def test_the_gptq_loader_reads_what_a_per_element_reading_does(bits, group, symmetric, act_order):
    from helpers.gptq_awq import gptq_layer
    from mm_engine.models.checkpoint_gptq import Gptq

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(bits + group))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(1)) if act_order else None
    tensors, meant = gptq_layer(w, bits, 64 if group == -1 else group, symmetric, order, v1=True)
    state, stored = Gptq(bits, 1).split({f"m.{name}": t for name, t in tensors.items()})
    reference = gptq_per_element(tensors, bits)
    assert torch.equal(reference, meant) and torch.equal(stored["m"].dequantize(), reference)
    assert set(state) == {"m.weight"} and torch.equal(state["m.weight"].load(), reference)
    assert stored["m"].kind == f"int{bits}" and (stored["m"].zeros is None) == symmetric
    assert (stored["m"].perm is None) == (not act_order)


def test_the_awq_loader_reads_what_a_per_element_reading_does():
    from helpers.gptq_awq import awq_layer
    from mm_engine.models.checkpoint_gptq import Awq

    tensors, meant = awq_layer(torch.randn(16, 64, generator=torch.Generator().manual_seed(2)), 16)
    _, stored = Awq().split({f"m.{name}": t for name, t in tensors.items()})
    reference = awq_per_element(tensors, 16)
    assert torch.equal(reference, meant) and torch.equal(stored["m"].dequantize(), reference)


@pytest.mark.parametrize(
    ("method", "options", "backend"),
    [
        ("gptq", {"bits": 4, "group": 32, "symmetric": False, "act_order": "shared"}, "cpu"),
        ("gptq", {"bits": 8, "group": 64, "symmetric": True, "act_order": "each"}, "triton"),
        ("awq", {"group": 32}, "cpu"),
    ],
)
def test_a_gptq_or_awq_checkpoint_equals_its_dequantized_twin(vl_family, tmp_path, method, options, backend):
    from helpers.gptq_awq import awq_checkpoint, gptq_checkpoint

    path, _ = vl_family("qwen2_vl")
    packed, twin = (gptq_checkpoint if method == "gptq" else awq_checkpoint)(path, tmp_path, **options)
    outs = run_batch_against(FamilyReference(twin), packed, backend, cases("qwen2_vl"))
    assert len(outs) == 3
    llm = LLM(packed, attention_backend="cpu", kv_cache_memory_bytes=4 * 1024**2)
    attn = llm.engine.core.model.language_model.layers[0].self_attn
    stored = [m for m in llm.engine.core.model.language_model.modules() if isinstance(m, QuantLinear)]
    assert stored and {m.kind for m in stored} == {f"int{options.get('bits', 4)}"}
    # act-order: the layers reading one input in one order are fused; in orders of their own, not
    assert (attn.qkv_proj is None) == (options.get("act_order") == "each")
    assert all(m.perm is not None for m in stored) == (method == "gptq")


def test_a_hybrid_model_keeps_projections_with_input_orders_of_their_own_unfused(vl_family, tmp_path):
    from helpers.gptq_awq import gptq_checkpoint

    path, _ = vl_family("qwen3_5")
    options = {"bits": 4, "group": 32, "symmetric": True, "act_order": "each"}
    packed, twin = gptq_checkpoint(path, tmp_path, **options)
    outs = run_batch_against(FamilyReference(twin), packed, "cpu", cases("qwen3_5")[2:])
    assert len(outs) == 1
    llm = LLM(packed, attention_backend="cpu", kv_cache_memory_bytes=4 * 1024**2)
    layers = llm.engine.core.model.language_model.layers
    linear = next(layer.linear_attn for layer in layers if layer.linear)
    full = next(layer.self_attn for layer in layers if not layer.linear)
    assert linear.in_proj is None and full.qkv_proj is None


def test_input_quantization_equals_the_compressed_tensors_librarys():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from mm_engine.models.layers.act_quant import fake_quantize as engine_fake_quantize

    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3)) * 4
    x[0, 2] = 0  # a zero row: the scale is eps
    for kind, args in (("int8", INT8), ("fp8", FP8)):
        token = QuantizationArgs(**{**args, "dynamic": True, "strategy": "token"})
        scale, zero = compute_dynamic_scales_and_zp(x, token, module=None)
        assert torch.equal(engine_fake_quantize(x[0], kind), fake_quantize(x, scale, zero, token)[0])
        static = QuantizationArgs(**{**args, "strategy": "tensor"})
        at = torch.tensor([0.02])
        assert torch.equal(engine_fake_quantize(x, kind, at), fake_quantize(x, at, torch.zeros(1), static))


@pytest.mark.parametrize(
    ("fmt", "weights", "inputs", "backend"),
    [
        ("float-quantized", {**FP8, "strategy": "block", "block_structure": [128, 128]},
         {**FP8, "dynamic": True, "strategy": "token"}, "cpu"),  # FP8_BLOCK weights, FP8_DYNAMIC inputs
        ("float-quantized", {**FP8, "strategy": "tensor"}, {**FP8, "strategy": "tensor"}, "torch"),  # FP8
        ("float-quantized", {**FP8, "strategy": "channel"},
         {**FP8, "dynamic": True, "strategy": "token"}, "triton"),  # FP8_DYNAMIC: torch._scaled_mm
        ("int-quantized", {**INT8, "strategy": "channel"},
         {**INT8, "dynamic": True, "strategy": "token"}, "cpu"),  # W8A8
    ],
)  # fmt: skip
def test_a_w8a8_checkpoint_written_by_compressed_tensors_runs_as_the_library_runs_it(
    vl_family, tmp_path, fmt, weights, inputs, backend
):
    from compressed_tensors.quantization import QuantizationArgs

    from helpers.compressed import compressed_checkpoint, dequantized_twin, input_quantized_reference

    path, _ = vl_family("qwen2_vl")
    stored, twin = tmp_path / "stored", tmp_path / "twin"
    compressed_checkpoint(path, stored, fmt, QuantizationArgs(**weights), QuantizationArgs(**inputs))
    dequantized_twin(stored, twin)
    ref = input_quantized_reference(stored, twin)
    llm = engine(str(stored), backend)
    batch = cases("qwen2_vl")
    outs = llm.generate([mm(p, imgs) for p, imgs, _ in batch], [greedy(n) for *_, n in batch])
    for out, (text, imgs, n) in zip(outs, batch, strict=True):
        assert_equal_but_near_ties(ref, text, imgs, n, out.outputs[0].token_ids)
    assert_all_free(llm)
    layers = [m for m in llm.engine.core.model.language_model.modules() if isinstance(m, QuantLinear)]
    kind = "fp8" if weights["type"] == "float" else "int8"
    assert layers
    assert {(m.kind, m.act, m.act_scale is None) for m in layers} == {(kind, kind, inputs["dynamic"])}
    assert all(m.fp8 for m in layers) == (backend == "triton")  # per-row FP8 scales on both sides


def assert_equal_but_near_ties(ref, text: str, imgs: list, n: int, tokens: list[int], tie: float = 0.05):
    """The engine's greedy `tokens` equal transformers' up to the first step where transformers'
    two candidates are within `tie` of each other: quantizing the input turns the last bits of a
    sum (the engine adds in another order) into a step of the int8/fp8 grid now and then, which
    moves a random tiny model's logits by about 1e-2 (an input 1e-6 off flips such a tie)."""
    inputs = ref.inputs(text, imgs)
    with torch.inference_mode():
        out = ref.model.generate(
            **inputs, max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    expected = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    step = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), None)
    if step is not None:
        scores = out.scores[step][0]
        assert scores[expected[step]] - scores[tokens[step]] < tie, (text, tokens, expected)
