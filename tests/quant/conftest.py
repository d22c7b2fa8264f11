"""The quantization tests' shared file: a tiny random ERNIE-Image checkpoint in bf16, written once per module
(the tests read it and write their results into their own tmp_path)."""
import pytest
import torch

from engine.models.random_weights import SIZES, save_random_checkpoint


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16") / "ernie-bf16.safetensors"
    save_random_checkpoint(str(path), SIZES["tiny"], seed=0, dtype=torch.bfloat16)
    return path
