"""Loading builds every module in the dtype it is given: the language model and projector in the
LM's dtype, the tower in the vision dtype, without touching torch's process-wide default dtype
(another thread building tensors while an engine loads must not see it change)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_engine import models
from mm_engine.models.loader import load_config
from mm_engine.models.platform import make_platform
from mm_engine.testing import FAMILIES, build_checkpoint


@pytest.mark.parametrize("family", FAMILIES)
def test_every_module_is_built_in_its_own_dtype(family, tmp_path, monkeypatch):
    path = build_checkpoint(family, tmp_path / family)

    def refuse(dtype):
        raise AssertionError(f"loading changed torch's default dtype to {dtype}")

    monkeypatch.setattr(torch, "set_default_dtype", refuse)
    cpu = torch.device("cpu")
    model = models.load_model(Path(path), load_config(Path(path)), torch.bfloat16, torch.float16, cpu,
                              make_platform(cpu, "torch"))  # fmt: skip
    assert torch.get_default_dtype() == torch.float32
    lm = {n: p.dtype for n, p in model.language_model.named_parameters()}
    assert lm and set(lm.values()) == {torch.bfloat16}, lm
    # The rest is the tower (vision dtype) and the projector or extra weights (LM dtype, except
    # where the family runs its merger inside the tower); nothing is left in float32.
    rest = {n: p.dtype for n, p in model.named_parameters() if not n.startswith("language_model.")}
    assert torch.float16 in rest.values() and set(rest.values()) <= {torch.float16, torch.bfloat16}, rest
    for name, buf in model.language_model.named_buffers():
        if name.endswith("inv_freq"):
            assert buf.dtype == torch.float32  # rotary frequencies stay float32 whatever the LM's
