"""The checkpoint-reader table (engine/io/readers.py) is the single source: a reader registered for a new
suffix is what ``open_checkpoint`` (and through it the loader, ``sgld quantize`` and the parallel opener)
uses for such a file, by name or by its first bytes, and for a folder's shards; pickles are refused before
any reader sees them."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine import CheckpointError, load_model
from engine.config import EngineConfig
from engine.features import quant as Q
from engine.io import readers
from engine.io.checkpoint import open_checkpoint
from engine.io.safetensors import SafetensorsFile
from engine.models.random_weights import SIZES, save_random_checkpoint
from engine.parallel import open_ranked_runner

CFG = SIZES["tiny"]
MAGIC = b"SGLDTEST"


class PrefixedFile(SafetensorsFile):
    """A test file kind: the magic, then a safetensors file (so the real reader does the parsing)."""

    opened = []

    def __init__(self, path):
        self.opened.append(path)
        plain = path + ".inner"
        with open(path, "rb") as src, open(plain, "wb") as dst:
            assert src.read(len(MAGIC)) == MAGIC
            shutil.copyfileobj(src, dst)
        super().__init__(plain)


class NoWorkers:
    alive, pids = True, []

    def __init__(self):
        self.specs = []

    def ensure(self, key, spec):
        self.specs.append(spec)


@pytest.fixture
def reader():
    PrefixedFile.opened = []
    r = readers.register_reader(readers.Reader("sgldtest", (".sgldtest",), lambda head: head.startswith(MAGIC),
                                               PrefixedFile))
    yield r
    readers.unregister_reader(r.name)


def _prefixed(tmp_path, name):
    plain = tmp_path / "plain.safetensors"
    save_random_checkpoint(str(plain), CFG, seed=0)
    path = tmp_path / name
    path.write_bytes(MAGIC + plain.read_bytes())
    return plain, path


def test_a_registered_reader_opens_its_suffix_everywhere(reader, tmp_path):
    plain, path = _prefixed(tmp_path, "model.sgldtest")
    ckpt = open_checkpoint(path)
    assert PrefixedFile.opened == [str(path)] and isinstance(ckpt.files[0], PrefixedFile)
    a, b = load_model(path).state_dict(), load_model(plain).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    Q.quantize_file(str(path), str(tmp_path / "q.safetensors"), "fp8")  # sgld quantize reads it through the table
    assert Q.model_quant_format(load_model(tmp_path / "q.safetensors")) == "fp8"
    PrefixedFile.opened = []  # the parallel opener reads the header in the parent through the table; no workers
    # start (a stub transport: spawned workers would not have this test's reader registered)
    forward = open_ranked_runner(str(path), EngineConfig(ulysses_degree=2, device="cpu"), transport=NoWorkers())
    assert PrefixedFile.opened == [str(path)] and forward.model_config.hidden_size == CFG.hidden_size
    assert forward.transport.specs[0]["path"] == str(path)


def test_a_reader_is_chosen_by_content_and_for_folder_shards(reader, tmp_path):
    _, path = _prefixed(tmp_path, "noname")
    assert readers.reader_for(str(path)) is reader
    assert isinstance(open_checkpoint(path).files[0], PrefixedFile)
    folder = tmp_path / "folder"
    folder.mkdir()
    os.rename(path, folder / "shard.sgldtest")
    assert [os.path.basename(f.path) for f in open_checkpoint(folder).files] == ["shard.sgldtest.inner"]


def test_without_the_reader_the_file_is_not_one_and_pickles_are_refused_first(reader, tmp_path):
    _, path = _prefixed(tmp_path, "model.sgldtest")
    readers.unregister_reader(reader.name)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        open_checkpoint(path)
    readers.register_reader(reader)
    pickle = tmp_path / "model.pt"
    pickle.write_bytes(MAGIC + b"\x80\x04.")  # the reader's magic: only the name says pickle, and it wins
    with pytest.raises(CheckpointError, match="pickle"):
        open_checkpoint(pickle)
    assert PrefixedFile.opened == []
