"""Small random Gemma 4 checkpoints laid out as the published ones are (config, safetensors,
tokenizer naming its image, audio and turn tokens, processor, chat template), for tests and
benchmarks. Nothing is downloaded; random weights generate arbitrary tokens.

Two versions, each with the mechanisms of one published line:
- `e` (E2B / E4B): per-layer embeddings, the last two layers sharing the KV of earlier ones with
  double-wide MLPs, causal attention everywhere;
- `large` (31B): global layers whose keys are their values (`attention_k_eq_v`) with their own
  KV head count, image tokens that see each other in the sliding layers, clipped tower linears;
- `moe` (26B-A4B): `large` with four experts (top two, width 32) beside every dense MLP.
Both: global heads twice the sliding ones' with a quarter of the head turning, final-logit
softcapping, a standardized tower output, `layer_scalar`s away from 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from mm_engine.testing.common import save_random_model, tiny_text, word_tokenizer

GEMMA4_SPECIAL = [
    "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>",
    "<audio|>", "<|audio|>", "<|video|>",
]  # fmt: skip
GEMMA4_CHAT_TEMPLATE = (
    "<bos>{% for message in messages %}<|turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
VERSIONS = ("e", "large", "moe")
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, FULL]


def build_gemma4_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    names = {
        "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
        "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>",
    }  # fmt: skip
    fast = word_tokenizer(
        GEMMA4_SPECIAL, "user model", vocab_size, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens=names,
    )  # fmt: skip
    fast.add_tokens(["\n"])
    return fast


def _adjust(model) -> None:
    """What random matrices leave constant: layer scalars, the tower's standardization, clip
    bounds (tight enough to clip some activations)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale")):
                param.uniform_(0.5, 1.5)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.uniform_(0.5, 1.5)
            elif name.endswith("std_bias"):
                buf.normal_(0.0, 0.5)
            elif name.endswith("std_scale"):
                buf.uniform_(0.5, 1.5)
            elif name.endswith(("input_min", "output_min")):
                buf.fill_(-2.0 if "input" in name else -3.0)
            elif name.endswith(("input_max", "output_max")):
                buf.fill_(2.0 if "input" in name else 3.0)


def build_gemma4_checkpoint(
    path: str | Path,
    version: str = "e",
    sliding_window: int = 24,
    max_soft_tokens: int = 70,
    seed: int = 0,
    text_dims: dict | None = None,
    vision_dims: dict | None = None,
    vocab_size: int | None = None,
    weight_scale: float = 4.0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random checkpoint of one of `VERSIONS`, tiny by default: five layers (sliding, sliding,
    global, sliding, global; windows of 24 tokens), sliding heads of 32 and global ones of 64,
    an 8-px patch pooled 2x2, images of up to `max_soft_tokens` tokens (70: the least the
    processor allows)."""
    from transformers import AutoConfig
    from transformers.models.gemma4 import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    path = Path(path)
    tokenizer = build_gemma4_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA4_SPECIAL}
    e, moe = version == "e", version == "moe"
    text = tiny_text(
        len(tokenizer), ids["<eos>"], ids["<pad>"], ids["<bos>"], None,
        num_hidden_layers=5, head_dim=32, global_head_dim=64, sliding_window=sliding_window,
        layer_types=LAYER_TYPES, final_logit_softcapping=30.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        hidden_size_per_layer_input=16 if e else 0, vocab_size_per_layer_input=len(tokenizer),
        num_kv_shared_layers=2 if e else 0, use_double_wide_mlp=e,
        attention_k_eq_v=not e, num_global_key_value_heads=None if e else 1,
        use_bidirectional_attention=None if e else "vision",
        enable_moe_block=moe, num_experts=4 if moe else None, top_k_experts=2 if moe else None,
        moe_intermediate_size=32 if moe else None,
    )  # fmt: skip
    text.update(text_dims or {})
    vision = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, patch_size=8, pooling_kernel_size=2, position_embedding_size=160,
        standardize=True, use_clipped_linears=not e,
    )  # fmt: skip
    vision.update(vision_dims or {})
    cfg = AutoConfig.for_model(
        "gemma4", text_config=text, vision_config=vision, audio_config=None,
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"], image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"], boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"],
    )  # fmt: skip
    save_random_model(cfg, path, seed, weight_scale, dtype, _adjust)
    image = Gemma4ImageProcessor(
        patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"],
        max_soft_tokens=max_soft_tokens,
    )  # fmt: skip
    Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=image,
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(),
        chat_template=GEMMA4_CHAT_TEMPLATE,
        image_seq_length=max_soft_tokens,
    ).save_pretrained(path)
    return path
