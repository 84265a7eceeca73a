"""A tiny checkpoint stored as transformers' fine-grained FP8, and its full-precision twin."""

from __future__ import annotations

import torch


def fp8_checkpoint(path: str, out) -> tuple[str, str]:
    """The checkpoint at `path` stored as transformers' fine-grained FP8 (each language-model
    projection in e4m3 with a float32 scale per 128 x 128 block), and the same checkpoint with
    those weights at their dequantized values: (fp8 copy, full-precision twin)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    fp8, twin = shutil.copytree(path, out / "fp8"), shutil.copytree(path, out / "twin")
    state = load_file(str(fp8 / "model.safetensors"))
    stored, plain = {}, {}
    for key, w in state.items():
        vision = any(v in key for v in ("visual", "vision", "merger", "projector"))
        if key.endswith("_proj.weight") and w.dim() == 2 and not vision:
            n, k = w.shape
            blocks = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128)).view(
                -(-n // 128), 128, -(-k // 128), 128
            )
            scale = blocks.abs().amax(dim=(1, 3)) / 448
            q = (w / scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(
                torch.float8_e4m3fn
            )
            stored[key], stored[key.replace(".weight", ".weight_scale_inv")] = q, scale
            plain[key] = q.float() * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        else:
            stored[key] = plain[key] = w
    save_file(stored, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(plain, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": block}))
    return str(fp8), str(twin)
