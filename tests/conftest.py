import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A tiny random ERNIE-Image checkpoint (real architecture) written to a temp file."""
    from engine.models.random_weights import SIZES, save_random_checkpoint

    path = tmp_path / "tiny-ernie.safetensors"
    save_random_checkpoint(str(path), SIZES["tiny"], seed=0)
    return path
