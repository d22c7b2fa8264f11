"""engine/models/prompt_enhancer.py against diffusers' own ``ErnieImagePipeline._enhance_prompt_with_pe`` on the same tiny
random PE (tests/tiny_pe.py: built from configs, no downloads), and its bad inputs."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from engine.errors import Cancelled, CheckpointError, InputError
from engine.models.prompt_enhancer import MAX_NEW_TOKENS_CAP, MAX_PROMPT_TOKENS, PromptEnhancer
from tests.tiny_pe import MAX_LENGTH, read_json, write_tiny_pe

pytest.importorskip("transformers")
diffusers_pe = pytest.importorskip("diffusers.pipelines.ernie_image.pipeline_ernie_image")
PROMPTS = ["a dog running on grass", "一只狗在草地上奔跑"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_tiny_pe(str(tmp_path_factory.mktemp("pe_release")))


@pytest.fixture(scope="module")
def enhancer(release):
    return PromptEnhancer.from_pretrained(release[0])


def diffusers_enhance(release, prompt, width, height, **kw):
    """diffusers' method, run on the pipeline's two PE components loaded by transformers itself (the method
    uses nothing else of the pipeline, whose other components would be a DiT, a VAE and a text encoder)."""
    from transformers import AutoTokenizer, Ministral3ForCausalLM
    holder = types.SimpleNamespace(pe=Ministral3ForCausalLM.from_pretrained(release[0]).eval(),
                                   pe_tokenizer=AutoTokenizer.from_pretrained(release[1]))
    return diffusers_pe.ErnieImagePipeline._enhance_prompt_with_pe(holder, prompt, torch.device("cpu"), width=width,
                                                                     height=height, **kw)


def test_greedy_revised_prompt_equals_diffusers(release, enhancer):
    ours = enhancer.enhance(PROMPTS, width=512, height=768, greedy=True)
    # diffusers decodes greedily when temperature and top_p are both 1.0 (do_sample = either differs)
    theirs = [diffusers_enhance(release, p, 512, 768, temperature=1.0, top_p=1.0) for p in PROMPTS]
    assert ours == theirs
    assert ours[0] != ours[1] and all(ours)
    assert enhancer.seconds > 0


def test_seeded_sampling_is_deterministic_and_equals_diffusers_sampling(release, enhancer):
    """The release's generation_config (temperature 0.6, top-p 0.95, as diffusers passes) sampled from a seed."""
    a = enhancer.enhance(PROMPTS[:1], 1024, 1024, seed=7)
    assert enhancer.enhance(PROMPTS[:1], 1024, 1024, seed=7) == a
    torch.manual_seed(7)
    assert [diffusers_enhance(release, PROMPTS[0], 1024, 1024)] == a
    others = {enhancer.enhance(PROMPTS[:1], 1024, 1024, seed=s)[0] for s in range(8, 12)}
    assert others - {a[0]}, "different seeds never changed the sample"
    # prompt i uses seed + i: a batch equals its prompts run one by one
    assert enhancer.enhance(PROMPTS, 1024, 1024, seed=7) == [a[0], enhancer.enhance(PROMPTS[1:], 1024, 1024, seed=8)[0]]
    state = torch.get_rng_state()
    enhancer.enhance(PROMPTS[:1], 64, 64, seed=3)
    assert torch.equal(torch.get_rng_state(), state), "the caller's RNG was changed"


def test_sampling_settings_come_from_generation_config(tmp_path, enhancer):
    greedy_release = write_tiny_pe(str(tmp_path / "g"), generation={"do_sample": False})
    pe = PromptEnhancer.from_pretrained(greedy_release[0])
    assert pe.sampling["do_sample"] is False
    assert pe.enhance(PROMPTS, 64, 64, seed=5) == enhancer.enhance(PROMPTS, 64, 64, greedy=True)
    bare = PromptEnhancer.from_pretrained(write_tiny_pe(str(tmp_path / "b"), generation={})[0])
    assert bare.sampling == {"do_sample": True, "temperature": 0.6, "top_p": 0.95}  # diffusers' values


def test_max_new_tokens_bound(enhancer):
    assert enhancer.max_new_tokens() == MAX_LENGTH  # the tokenizer's model_max_length, as diffusers
    enhancer.enhance(PROMPTS[:1], 64, 64, greedy=True, max_new_tokens=3)
    assert enhancer.new_tokens == [3]
    enhancer.enhance(PROMPTS, 64, 64, greedy=True)
    assert all(1 <= n <= MAX_LENGTH for n in enhancer.new_tokens) and MAX_LENGTH in enhancer.new_tokens
    for bad in (0, MAX_NEW_TOKENS_CAP + 1, 2.5):
        with pytest.raises(InputError, match="max_new_tokens must be a whole number from 1 to"):
            enhancer.enhance(PROMPTS[:1], 64, 64, max_new_tokens=bad)
    with pytest.raises(InputError, match="width must be a positive"):
        enhancer.enhance(PROMPTS[:1], 0, 64)


def test_release_frees_and_reloads(release):
    pe = PromptEnhancer.from_pretrained(release[0])
    first = pe.enhance(PROMPTS[:1], 64, 64, greedy=True)
    pe.release()
    assert pe.model is None
    assert pe.enhance(PROMPTS[:1], 64, 64, greedy=True) == first
    pe.release()
    pe._loader = None
    with pytest.raises(InputError, match="was released"):
        pe.enhance(PROMPTS[:1], 64, 64)


def test_under_inference_mode(enhancer):
    """ComfyUI runs nodes under inference mode; the pipeline may call the PE there."""
    plain = enhancer.enhance(PROMPTS[:1], 64, 64, greedy=True)
    with torch.inference_mode():
        assert enhancer.enhance(PROMPTS[:1], 64, 64, greedy=True) == plain


def test_single_file_with_config_folder(tmp_path, release, enhancer):
    """ComfyUI's ernie-image-prompt-enhancer.safetensors style: one file, its config in a given folder."""
    single = tmp_path / "ernie-image-prompt-enhancer.safetensors"
    shutil.copy(os.path.join(release[0], "model.safetensors"), single)
    with pytest.raises(CheckpointError, match=r"config\.json: missing; a single prompt enhancer file"):
        PromptEnhancer.from_pretrained(str(single), tokenizer=release[1])
    pe = PromptEnhancer.from_pretrained(str(single), tokenizer=release[1], config=release[0])
    assert pe.enhance(PROMPTS, 64, 64, greedy=True) == enhancer.enhance(PROMPTS, 64, 64, greedy=True)


def test_bad_inputs_name_the_file(tmp_path, release):
    lone = tmp_path / "lone" / "pe"
    shutil.copytree(release[0], lone)  # a PE folder without pe_tokenizer/ beside it or tokenizer files inside
    with pytest.raises(CheckpointError, match=r"pe_tokenizer: no prompt enhancer tokenizer"):
        PromptEnhancer.from_pretrained(str(lone))

    pickled = tmp_path / "pickled" / "pe"
    shutil.copytree(release[0], pickled)
    torch.save({"w": torch.zeros(1)}, pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*pickle"):
        PromptEnhancer.from_pretrained(str(pickled), tokenizer=release[1])

    no_config = tmp_path / "noconf" / "pe"
    shutil.copytree(release[0], no_config)
    os.remove(no_config / "config.json")
    with pytest.raises(CheckpointError, match=r"pe/config\.json: missing"):
        PromptEnhancer.from_pretrained(str(no_config), tokenizer=release[1])

    no_template = tmp_path / "notemplate"
    shutil.copytree(release[1], no_template)
    os.remove(no_template / "chat_template.jinja")
    with pytest.raises(CheckpointError, match="has no chat template"):
        PromptEnhancer.from_pretrained(release[0], tokenizer=str(no_template))

    damaged = tmp_path / "damaged" / "pe"
    shutil.copytree(release[0], damaged)
    (damaged / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        PromptEnhancer.from_pretrained(str(damaged), tokenizer=release[1])

    with pytest.raises(CheckpointError, match="prompt enhancer not found"):
        PromptEnhancer.from_pretrained(str(tmp_path / "nowhere"))


def test_own_dtype_and_device(release):
    """The PE on its own dtype (bf16 here, whatever the caller's default) and, where there is one, a GPU."""
    pe = PromptEnhancer.from_pretrained(release[0], dtype="bf16")
    assert {p.dtype for p in pe.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert all(pe.enhance(PROMPTS, 64, 64, seed=1)) and pe.enhance(PROMPTS, 64, 64, seed=1) == pe.enhance(PROMPTS, 64, 64, seed=1)
    with pytest.raises(ValueError, match="prompt enhancer dtype 'int8'"):
        PromptEnhancer.from_pretrained(release[0], dtype="int8")
    if not torch.cuda.is_available():
        return  # this machine has no GPU: the CUDA half runs where there is one
    gpu = PromptEnhancer.from_pretrained(release[0], device="cuda", dtype="bf16")
    assert next(gpu.model.parameters()).device.type == "cuda"
    state = torch.cuda.get_rng_state()
    assert gpu.enhance(PROMPTS, 64, 64, seed=2) == gpu.enhance(PROMPTS, 64, 64, seed=2)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    gpu.release()
    assert gpu.model is None


def edited_copy(tmp_path, release, name: str, **changes) -> str:
    """A copy of the tiny PE folder with fields of its JSON file ``name`` changed."""
    folder = tmp_path / f"pe-{len(os.listdir(tmp_path))}"
    shutil.copytree(release[0], folder)
    data = read_json(folder / name)
    data.update(changes)
    (folder / name).write_text(json.dumps(data))
    return str(folder)


def test_generation_config_checked_at_load(tmp_path, release):
    """A bad sampling setting is refused at load naming the file and field, not a ValueError on every request."""
    for field, value, allowed in (("temperature", "hot", "a number above 0"), ("temperature", -1, "a number above 0"),
                                  ("top_k", -5, "a whole number from 0"), ("top_k", 2.5, "a whole number from 0"),
                                  ("top_p", 1.5, "a number from 0 to 1"), ("do_sample", "yes", "true or false")):
        folder = edited_copy(tmp_path, release, "generation_config.json", **{field: value})
        with pytest.raises(CheckpointError, match=rf"generation_config\.json: field '{field}' must be {allowed}"):
            PromptEnhancer.from_pretrained(folder, tokenizer=release[1])
    # a JSON whole number is a number (transformers' processors want a float temperature)
    pe = PromptEnhancer.from_pretrained(edited_copy(tmp_path, release, "generation_config.json", temperature=2, top_k=0),
                                        tokenizer=release[1])
    assert pe.sampling["temperature"] == 2.0 and pe.enhance(PROMPTS[:1], 64, 64, seed=0)


def test_prompt_over_the_token_limit_is_refused_before_any_runs(enhancer):
    long = "a cat " * 1200  # about 4800 tokens in the chat template: past the limit, and seconds of prefill
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=rf"prompt: \d+ tokens .* over its limit of {MAX_PROMPT_TOKENS} tokens"):
        enhancer.enhance([PROMPTS[0], long], 64, 64, greedy=True)
    assert time.perf_counter() - t0 < 1.5
    assert enhancer.enhance(["a cat " * 300], 64, 64, greedy=True)  # ~1200 tokens: read


def test_stop_ends_the_generation_at_the_next_token(tmp_path):
    """What `sgld serve` sets when a request times out or its client leaves: the PE stops writing (and frees
    the server's PE lock) instead of running on for nobody. An endless PE writes until max_new_tokens."""
    pe = PromptEnhancer.from_pretrained(write_tiny_pe(str(tmp_path), generation={"do_sample": False}, endless=True)[0])
    assert pe.enhance(PROMPTS[:1], 64, 64, max_new_tokens=20) and pe.new_tokens == [20]
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.perf_counter()
    with pytest.raises(Cancelled, match="stopped while it wrote"):
        pe.enhance(PROMPTS[:1], 64, 64, max_new_tokens=MAX_NEW_TOKENS_CAP, stop=stop)  # minutes if not stopped
    assert time.perf_counter() - t0 < 3
    with pytest.raises(Cancelled, match="stopped before it began"):
        pe.enhance(PROMPTS[:1], 64, 64, stop=stop)


ABSURD_CONFIGS = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # the old code's allocations die here, not on the machine
from engine.errors import CheckpointError
from engine.models.prompt_enhancer import PromptEnhancer
from transformers import Ministral3ForCausalLM  # imported before the clock starts
for folder in sys.argv[2:]:
    t0 = time.perf_counter()
    try:
        PromptEnhancer.from_pretrained(folder, tokenizer=sys.argv[1])
        print(json.dumps({"loaded": folder}), flush=True)
    except CheckpointError as e:
        print(json.dumps({"error": str(e), "seconds": time.perf_counter() - t0}), flush=True)
"""


@pytest.mark.subprocess
def test_config_sizes_checked_against_the_weights_before_allocation(tmp_path, release):
    """config.json against the safetensors header, on the meta device: absurd sizes are refused in about a second
    naming the file and the field, before transformers allocates (or builds a million layers). In a child
    process under an address-space limit, so that the old code fails cheaply."""
    cases = [({"vocab_size": 2_000_000, "hidden_size": 20_000, "head_dim": 5_000}, r"key 'model\.embed_tokens\.weight' "
              r"is \[300, 32\] in .*model\.safetensors, but the config makes it \[2000000, 20000\] \(field "
              r"'hidden_size' = 20000, 'vocab_size' = 2000000"),
             ({"num_hidden_layers": 1_000_000}, r"field 'num_hidden_layers' = 1000000 asks for more layers or blocks "
              r"than the weights hold tensors \(20\)"),
             ({"num_hidden_layers": 3}, r"key 'model\.layers\.2\.self_attn\.q_proj\.weight' is not in the weights "
              r"\(.*model\.safetensors\): the config's sizes \(.*num_hidden_layers 3.*\) describe 37,472 values, the "
              r"weights hold 28,192"),
             ({"tie_word_embeddings": False}, r"key 'lm_head\.weight' is not in the weights")]
    folders = [edited_copy(tmp_path, release, "config.json", **changes) for changes, _ in cases]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run([sys.executable, "-c", ABSURD_CONFIGS, release[1], *folders], capture_output=True, text=True,
                          timeout=120, env=env)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), done.stdout + done.stderr[-3000:]
    for (_, pattern), folder, result in zip(cases, folders, results):
        assert "error" in result, result
        assert result["error"].startswith(os.path.join(folder, "config.json") + ": "), result
        assert re.search(pattern, result["error"]), result
        assert result["seconds"] < 20, result  # about a second each here


def test_a_gpu_without_room_beside_the_dit_has_the_pe_write_on_the_cpu(release, enhancer, monkeypatch, caplog):
    """A GPU too full for the PE's weights and work beside what it holds (a served batch sampling): the PE writes
    where its weights wait, on the host, the same revised prompt, and says so once. The full GPU is a stand-in
    (this machine has none): the device layer's free-memory answer, which the GPU rehearsal checks on a lent card."""
    import engine.device as device_rt

    monkeypatch.setattr(device_rt, "free_bytes", lambda device: 0 if torch.device(device).type == "cuda" else None)
    pe = PromptEnhancer.from_pretrained(release[0], device="cuda", dtype="fp32")
    with caplog.at_level("WARNING", logger="sgld.parts"):
        first = pe.enhance(PROMPTS, 512, 768, greedy=True)
        assert pe.enhance(PROMPTS[:1], 512, 768, greedy=True) == first[:1]
    assert first == enhancer.enhance(PROMPTS, 512, 768, greedy=True)
    assert all(p.device.type == "cpu" for p in pe.model.parameters())
    said = [m for m in caplog.messages if "do not fit" in m]
    assert len(said) == 1 and "writing on the CPU" in said[0] and "--pe-device cpu" in said[0], said
