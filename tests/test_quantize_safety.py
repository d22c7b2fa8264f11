"""`sgld quantize` never destroys its input and never leaves a part file behind (issue 44, items 1 and 2).

The output is refused when its write would replace the input: the same file reached through a symlinked folder,
an input that is a symlink to the output, a file inside the input release folder. A SIGTERM or SIGHUP mid-write
removes the part file (exit 128 + the signal); a part file a SIGKILL left is removed by the next write of that
output, while one a live writer holds locked is kept."""
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from engine.io.atomic import atomic_write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}
# The real CLI in a real process, each written tensor slowed down, so a signal surely lands mid-write.
SLOW_QUANTIZE = r"""
import sys, time
import engine.features.quant.convert as convert
write = convert.write_safetensors_streaming
convert.write_safetensors_streaming = lambda path, specs, produce, meta: write(
    path, specs, lambda key: (time.sleep(0.2), produce(key))[1], meta)
from engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def quantize(src, dst, fmt="int8"):
    from engine.cli import build_parser
    from engine.cli import quantize as q

    return q.cmd_quantize(build_parser().parse_args(["quantize", str(src), str(dst), "--format", fmt]))


def parts(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".part"))


# -- item 1: the output is never the input ------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "q8_0"])
def test_an_output_through_a_symlinked_folder_is_refused(tiny_checkpoint, tmp_path, fmt):
    src = tmp_path / "weights" / "model.safetensors"
    src.parent.mkdir()
    shutil.move(tiny_checkpoint, src)
    if fmt == "q8_0":  # the GGUF writer: an input of its own kind, the output the same file by another path
        src = tmp_path / "weights" / "model.gguf"
        quantize(tmp_path / "weights" / "model.safetensors", src, "q8_0")
    os.symlink(tmp_path / "weights", tmp_path / "link")
    before = digest(src)
    dst = tmp_path / "link" / src.name
    with pytest.raises(ValueError) as err:
        quantize(src, dst, fmt)
    assert str(err.value) == f"output '{dst}' is the input '{src}' (the same file): the output must differ from the input"
    assert digest(src) == before and parts(src.parent) == []


def test_an_input_that_is_a_symlink_to_the_output_is_refused(tiny_checkpoint, tmp_path):
    real = tmp_path / "model.safetensors"
    shutil.move(tiny_checkpoint, real)
    link = tmp_path / "input.safetensors"
    os.symlink(real, link)
    before = digest(real)
    with pytest.raises(ValueError) as err:
        quantize(link, real)
    assert str(err.value) == f"output '{real}' is the input '{link}' (the same file): the output must differ from the input"
    assert digest(real) == before and os.path.islink(link) and parts(tmp_path) == []


@pytest.mark.parametrize("fmt", ["fp8", "q4_0"])
def test_an_output_inside_the_input_release_folder_is_refused(tiny_checkpoint, tmp_path, fmt):
    release = tmp_path / "release"
    (release / "transformer").mkdir(parents=True)
    weights = release / "transformer" / "diffusion_pytorch_model.safetensors"
    shutil.move(tiny_checkpoint, weights)
    before = digest(weights)
    dst = release / "transformer" / ("diffusion_pytorch_model.safetensors" if fmt == "fp8" else "x.gguf")
    with pytest.raises(ValueError) as err:
        quantize(release, dst, fmt)
    assert str(err.value) == f"output '{dst}' is inside the input folder '{release}': write it outside that folder"
    assert digest(weights) == before and sorted(os.listdir(weights.parent)) == [weights.name]


@pytest.mark.subprocess
def test_the_cli_prints_the_refusal_in_one_line(tiny_checkpoint, tmp_path):
    os.symlink(tmp_path, tmp_path / "self")  # the folder again, under another name
    dst = tmp_path / "self" / tiny_checkpoint.name
    before = digest(tiny_checkpoint)
    r = subprocess.run([sys.executable, "-m", "engine.cli", "quantize", str(tiny_checkpoint), str(dst), "--format", "int8"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == (f"sgld quantize: error: output '{dst}' is the input "
                                                      f"'{tiny_checkpoint}' (the same file): the output must differ from the input")
    assert digest(tiny_checkpoint) == before


def test_a_copy_beside_the_input_is_still_written(tiny_checkpoint, tmp_path):
    summary = quantize(tiny_checkpoint, tmp_path / "copy.safetensors")
    assert summary["layers"] > 0 and os.path.getsize(tmp_path / "copy.safetensors") > 0


# -- item 2: no part file left behind -----------------------------------------------------------------------

@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_write_removes_the_part_file_and_keeps_the_old_output(tmp_path, sig):
    out = tmp_path / "demo-int8.safetensors"
    out.write_bytes(b"the previous copy")
    p = subprocess.Popen([sys.executable, "-c", SLOW_QUANTIZE, "quantize", "demo", str(out), "--format", "int8"],
                         env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not [n for n in parts(tmp_path) if os.path.getsize(tmp_path / n) > 0]:  # written to: mid-write
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        p.send_signal(sig)
        _, stderr = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, stderr
    assert stderr.strip() == f"sgld quantize: terminated by {signal.Signals(sig).name}" and "Traceback" not in stderr
    assert sorted(os.listdir(tmp_path)) == [out.name] and out.read_bytes() == b"the previous copy"


def _part_of(out, tag):
    """A part file named as atomic_write names them (mkstemp's 8 random characters)."""
    part = out.parent / f".{out.name}.{tag:_<8}.part"
    part.write_bytes(b"x" * 4096)
    return part


@pytest.mark.subprocess
def test_the_next_write_removes_a_killed_runs_part_file_but_not_a_live_writers(tmp_path):
    out = tmp_path / "demo-int8.safetensors"
    stale = _part_of(out, "killed")  # what a SIGKILL leaves: nobody holds it
    live = _part_of(out, "live")
    other = tmp_path / ".demo-int8.safetensors.bak.abcdefgh.part"  # another output's part file
    other.write_bytes(b"y")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'rb'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()", str(live)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = subprocess.run([sys.executable, "-m", "engine.cli", "quantize", "demo", str(out), "--format", "int8"],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        assert not stale.exists() and live.exists() and other.exists()
        assert sorted(os.listdir(tmp_path)) == sorted([out.name, live.name, other.name])
    finally:
        holder.communicate("", timeout=30)


def test_a_writer_keeps_another_writers_part_file_and_sweeps_only_regular_files_of_its_output(tmp_path):
    out = tmp_path / "x.safetensors"
    target = tmp_path / "keep.bin"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / ".x.safetensors.symlink_.part")  # a link: never followed, never removed
    with atomic_write(str(out)) as first:  # the first writer's part file is locked while it writes
        first.write(b"first")
        with atomic_write(str(out)) as second:
            second.write(b"second")
            assert len(parts(tmp_path)) == 3
        (mine,) = [n for n in parts(tmp_path) if not n.startswith(".x.safetensors.symlink_")]
        with open(tmp_path / mine, "rb") as f:  # still locked by its writer
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert out.read_bytes() == b"first" and target.read_bytes() == b"keep"
    assert os.path.islink(tmp_path / ".x.safetensors.symlink_.part")
