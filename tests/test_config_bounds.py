"""Configs are checked against the weights' header before anything is allocated (issue 33, point 1).

A ``config.json`` with absurd sizes beside tiny real weight files (written by diffusers / transformers
``save_pretrained``): the Flux.2 VAE's ``block_out_channels [40000, 40000]`` (57.6 GB of weights), the text
encoder's vocab 2e6 x hidden 20000 (160 GB), counts that would make millions of modules, and the DiT's
transformer/config.json. Each case runs in one child process under an address-space limit (RLIMIT_AS, a few GB
above what the imports use), so the code before the fix, which allocated the config's sizes first, ends in a raw
``RuntimeError`` without touching the shared machine's memory; now each is a CheckpointError naming the file and
the config field, in well under a second, with no growth of the process's peak memory."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.subprocess]

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, resource, shutil, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import tiny_release
from engine.loading import load_model
from engine.models.external import Flux2VAE, TextEncoder
from engine.models.random_weights import SIZES, random_state_dict, save_random_checkpoint
from safetensors.torch import save_file

tmp = sys.argv[2]


def edit(folder, change):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    change(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return folder


def copy(source, name, change):
    folder = os.path.join(tmp, name)
    shutil.copytree(source, folder)
    return edit(folder, change)


vae = os.path.join(tmp, "vae")
tiny_release.vae(32).save_pretrained(vae)
te = os.path.join(tmp, "text_encoder")
tiny_release.text_encoder(64, 20).save_pretrained(te)
tiny_release.tokenizer().save_pretrained(te)


def wide_vae(c):
    c["block_out_channels"] = [40000, 40000]


def deep_vae(c):
    c["layers_per_block"] = 10 ** 7


def wide_te(c):
    c["text_config"].update(vocab_size=2 * 10 ** 6, hidden_size=20000)


def deep_te(c):
    c["text_config"]["num_hidden_layers"] = 10 ** 8


dit = os.path.join(tmp, "release", "transformer")
os.makedirs(dit)
save_random_checkpoint(os.path.join(dit, "diffusion_pytorch_model.safetensors"), SIZES["tiny"])
with open(os.path.join(dit, "config.json"), "w") as f:
    json.dump({"hidden_size": 10 ** 6, "num_layers": 10 ** 6, "ffn_hidden_size": 10 ** 7}, f)
single = os.path.join(tmp, "single")  # a DiT file: its metadata's config restates, a config.json beside is not read
os.makedirs(single)
save_file(random_state_dict(SIZES["tiny"]), os.path.join(single, "dit.safetensors"),
          metadata={"ernie_image_config": json.dumps({"hidden_size": 10 ** 6, "num_layers": 10 ** 6})})
save_random_checkpoint(os.path.join(single, "plain.safetensors"), SIZES["tiny"])
shutil.copy(os.path.join(dit, "config.json"), single)
wv, dv = copy(vae, "wide_vae", wide_vae), copy(vae, "deep_vae", deep_vae)
wt, dt = copy(te, "wide_te", wide_te), copy(te, "deep_te", deep_te)
cases = {
    "vae_folder": lambda: Flux2VAE.load(wv),
    "vae_file": lambda: Flux2VAE.load(os.path.join(wv, "diffusion_pytorch_model.safetensors")),
    "vae_file_config": lambda: Flux2VAE.load(os.path.join(dv, "diffusion_pytorch_model.safetensors"), config=dv),
    "te_folder": lambda: TextEncoder.load(wt),
    "te_file": lambda: TextEncoder.load(os.path.join(wt, "model.safetensors")),
    "te_layers": lambda: TextEncoder.load(os.path.join(dt, "model.safetensors")),
    "dit_release": lambda: load_model(os.path.join(tmp, "release")),
    "dit_folder": lambda: load_model(dit),
    "dit_metadata": lambda: load_model(os.path.join(single, "dit.safetensors")),
    "dit_beside": lambda: load_model(os.path.join(single, "plain.safetensors")),
}
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), vm + (3 << 30)))
for name, run in cases.items():
    peak, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.process_time()
    try:
        run()
        error = "loaded"
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"case": name, "error": error, "cpu_s": time.process_time() - cpu,
                      "growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024}), flush=True)
"""


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    r = subprocess.run([sys.executable, "-c", CHILD, ROOT, str(tmp)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, r.stderr[-3000:]
    return {line["case"]: line for line in lines}, str(tmp)


@pytest.mark.parametrize("case, file, field", [
    ("vae_folder", "wide_vae", r"'block_out_channels' = \[40000, 40000\]"),
    ("vae_file", "wide_vae/diffusion_pytorch_model.safetensors", r"'block_out_channels' = \[40000, 40000\]"),
    ("vae_file_config", "deep_vae/config.json", r"field 'layers_per_block' = 10000000"),
    ("te_folder", "wide_te", r"'text_config.vocab_size' = 2000000, 'text_config.hidden_size' = 20000"),
    ("te_file", "wide_te/model.safetensors", r"'text_config.vocab_size' = 2000000, 'text_config.hidden_size' = 20000"),
    ("te_layers", "deep_te/config.json", r"field 'text_config.num_hidden_layers' = 100000000"),
    ("dit_release", "release/transformer/config.json", r"field 'hidden_size' = 1000000"),
    ("dit_folder", "release/transformer/config.json", r"field 'hidden_size' = 1000000"),
    ("dit_metadata", "single/dit.safetensors", r"metadata 'ernie_image_config': field 'hidden_size' = 1000000"),
])
def test_absurd_config_is_refused_before_allocation(refused, case, file, field):
    import re

    results, tmp = refused
    got = results.get(case)
    assert got is not None, f"the child stopped before case {case}: {sorted(results)}"
    assert got["error"].startswith("CheckpointError: "), got["error"][:600]
    assert os.path.join(tmp, file) in got["error"] and re.search(field, got["error"]), got["error"]
    # measured: 0 MB and ~0.03 s each; before the fix a raw RuntimeError asking for 57.6 GB / 160 GB
    assert got["growth_mb"] < 200 and got["cpu_s"] < 5, got


def test_a_config_beside_a_dit_file_is_not_what_sizes_it(refused):
    """A single DiT file is sized by its header alone: the absurd config.json beside it allocates nothing."""
    results, _ = refused
    assert results["dit_beside"]["error"] == "loaded" and results["dit_beside"]["growth_mb"] < 200, results["dit_beside"]
