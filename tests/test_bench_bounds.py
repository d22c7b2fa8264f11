"""`sgld bench`'s sizes and SGLD_OFFLOAD_WORKING_GB are refused in one line naming the flag or variable and what
is allowed (issue 44, item 12). Before: --width -16 / --height 8 / --text-tokens -3 were raw torch tracebacks,
--width 1000000000 / --text-tokens 100000000 asked for tens of GB, --width 0 quietly became 256; the variable's
``abc`` / ``nan`` / ``inf`` were bare ValueError / OverflowError tracebacks and ``-1`` switched auto's margin off.

The bench cases run through the CLI's main in one child process under an address-space limit (as
tests/test_config_bounds.py does), so a regression ends in an allocation error, not in the machine's memory."""
import json
import os
import subprocess
import sys

import pytest

from engine.features import offload as O

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
SIDE = "must be from 1 to 4096 pixels (got {}; ERNIE-Image's largest documented size is 2048x2048)"
TOKENS = "--text-tokens must be an integer from 1 to 2048 (got {}; the text encoder reads at most 2048)"
STRIDE = "--width must be a multiple of 16 pixels (got 100; ERNIE-Image's latent has one cell per 16x16 pixels)"
REFUSED = {
    "width -16": (["--width", "-16"], "--width " + SIDE.format(-16)),
    "width 0": (["--width", "0"], "--width " + SIDE.format(0)),
    "width 1000000000": (["--width", "1000000000"], "--width " + SIDE.format(1000000000)),
    "height 8": (["--height", "8"], "--height must be an integer from 16 to 4096 (got 8)"),
    "width 100": (["--width", "100"], STRIDE),
    "model width 100": (["--model", "{ckpt}", "--width", "100"], STRIDE),  # a model file's family: once it is open
    "text-tokens -3": (["--text-tokens", "-3"], TOKENS.format(-3)),
    "text-tokens 0": (["--text-tokens", "0"], TOKENS.format(0)),
    "text-tokens 100000000": (["--text-tokens", "100000000"], TOKENS.format(100000000)),
    "width 1e9": (["--width", "1e9"], "argument --width: invalid int value: '1e9'"),  # argparse's own line
    "text-tokens 1e8": (["--text-tokens", "1e8"], "argument --text-tokens: invalid int value: '1e8'"),
}
GOOD = ["--width", "64", "--height", "32", "--text-tokens", "2048", "--steps", "0", "--repeat", "1", "--json"]

CHILD = r"""
import contextlib, io, json, os, resource, sys
from engine.cli import main
from engine.models.random_weights import SIZES, save_random_checkpoint

ckpt = os.path.join(sys.argv[1], "tiny.safetensors")
save_random_checkpoint(ckpt, SIZES["tiny"], seed=0)
cases = json.loads(sys.argv[2])
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), vm + (3 << 30)))
for name, argv in cases.items():
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main(["bench", *[a.replace("{ckpt}", ckpt) for a in argv]])
    except SystemExit as e:  # argparse
        rc = e.code
    except BaseException as e:
        rc = f"raised {type(e).__name__}: {e}"[:300]
    print(json.dumps({"case": name, "rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue()}), flush=True)
"""


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    cases = {name: argv for name, (argv, _) in REFUSED.items()}
    cases["good"] = GOOD
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path_factory.mktemp("bench")), json.dumps(cases)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, r.stderr[-3000:]
    return {line["case"]: line for line in lines}


@pytest.mark.subprocess
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_bench_size_is_one_line_naming_the_flag(bench_runs, case):
    got = bench_runs.get(case)
    assert got is not None, f"the child stopped before case {case}: {sorted(bench_runs)}"
    assert got["rc"] == 2, got
    lines = [line for line in got["stderr"].strip().splitlines() if not line.startswith("sgld: ")]  # the load's notes
    assert "Traceback" not in got["stderr"] and lines[-1] == f"sgld bench: error: {REFUSED[case][1]}", got
    assert len(lines) == 1 or lines[0].startswith("usage: "), got  # argparse prints its usage line first


@pytest.mark.subprocess
def test_the_largest_text_and_a_small_picture_run(bench_runs):
    got = bench_runs["good"]
    assert got["rc"] == 0, got
    out = json.loads(got["stdout"])
    assert out["latent"][1:] == [2, 4] and out["text_tokens"] == 2048


# -- SGLD_OFFLOAD_WORKING_GB -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-inf", "-1", "1e6", ""])
def test_a_bad_working_memory_variable_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("SGLD_OFFLOAD_WORKING_GB", value)
    monkeypatch.setattr("engine.device.free_bytes", lambda dev: 3 * GIB)
    if value == "":  # unset in effect: the defaults
        assert O.working_bytes(16 * GIB) == int(0.15 * 16 * GIB)
        return
    message = (f"environment variable SGLD_OFFLOAD_WORKING_GB={value!r} is not valid: it must be a number of GiB from 0 "
               "to 1024 (unset: at least 2 GiB or 15% of the model); fix or unset it")
    for decide in (lambda: O.choose_offload("auto", "cuda:0", 16 * GIB, free_bytes=40 * GIB),
                   lambda: O.choose_call_offload("cuda:0", GIB)):
        with pytest.raises(ValueError) as err:
            decide()
        assert str(err.value) == message


def test_a_good_working_memory_variable_is_honoured(monkeypatch):
    monkeypatch.setattr("engine.device.free_bytes", lambda dev: 3 * GIB)
    monkeypatch.setenv("SGLD_OFFLOAD_WORKING_GB", "10")  # 16 + 10 > 20 free: offload; the default (2.4) would not
    assert O.choose_offload("auto", "cuda:0", 16 * GIB, free_bytes=20 * GIB)[0] == "layerwise"
    assert O.choose_call_offload("cuda:0", 1)[0] == "layerwise"  # 10 GiB wanted, 3 free
    monkeypatch.setenv("SGLD_OFFLOAD_WORKING_GB", " 0.5 ")
    assert O.choose_offload("auto", "cuda:0", 16 * GIB, free_bytes=17 * GIB)[0] == "none"
    assert O.choose_call_offload("cuda:0", 100 * GIB)[0] == "none"  # the variable, not the estimate
    monkeypatch.setenv("SGLD_OFFLOAD_WORKING_GB", "0")
    assert O.working_bytes(16 * GIB) == 0
    monkeypatch.delenv("SGLD_OFFLOAD_WORKING_GB")
    assert O.choose_offload("auto", "cuda:0", 16 * GIB, free_bytes=17 * GIB)[0] == "layerwise"  # 2.4 GiB default
