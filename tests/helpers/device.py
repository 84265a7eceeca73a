"""The device of the Triton tests: CPU tensors under the interpreter by default;
MM_ENGINE_TEST_DEVICE=cuda runs them compiled on a GPU instead (the rest of the suite stays on
CPU). tests/conftest.py sets TRITON_INTERPRET before triton is first imported."""

from __future__ import annotations

import os

import torch

TEST_DEVICE_NAME = os.environ.get("MM_ENGINE_TEST_DEVICE", "cpu")
TEST_DEVICE = torch.device(TEST_DEVICE_NAME)
