"""Find a checkpoint folder (locally, or on the Hub when the name is no folder) and read its config;
what to build from it is the model family's business (`mm_engine.models`)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

import mm_engine.models as models


def resolve_model_path(model: str | Path) -> Path:
    """A local folder as it is; anything else is fetched from the Hugging Face Hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model must be a checkpoint folder or a Hub model name, not a file: {path.name}")
    from huggingface_hub import snapshot_download

    try:
        patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
        return Path(snapshot_download(str(model), allow_patterns=patterns))
    except Exception as exc:  # network off, unknown repo, ...: say which, without internals
        raise ValueError(
            f"model {str(model)!r} is not a local folder and could not be downloaded ({type(exc).__name__})"
        ) from None


def load_config(path: Path):
    """The checkpoint's config, refused with a clear error when no family here serves it."""
    if not (path / "config.json").is_file():
        raise ValueError(f"no config.json in the model folder {path.name!r}")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:  # a model_type this transformers does not know
        raise ValueError(
            f"unsupported architecture ({exc.__class__.__name__} reading config.json); "
            f"supported: {', '.join(models.SUPPORTED_ARCHITECTURES)}"
        ) from None
    # The language model is what a quantized checkpoint stores quantized: its config says so too.
    quant, text = getattr(config, "quantization_config", None), getattr(config, "text_config", None)
    if quant and text is not None and not getattr(text, "quantization_config", None):
        text.quantization_config = quant
    models.check_config(config)
    return config
