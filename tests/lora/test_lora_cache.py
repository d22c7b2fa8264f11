"""The per-request LoRA cache under load and attack (issue 44 items 3-9 and 11; engine/features/lora/rows.py,
engine/serve/batcher.py), on the tiny fp32 model in-process: the data alive stays within the budget plus the running
forward's LoRAs however many jobs wait; what a LoRA costs resident (file and side-path terms) is known from its
header and refused past the budget before any data is read; one file named by many requests at once is read
once and is one LoRA; a ``.diff`` stored in another shape of the layer's size runs; a LoRA that cannot be made
ready fails only its own job; a job waiting for LoRA room lets the jobs behind it pass, a bounded number of them;
a file's aliases are one file; a file replaced with its times kept is read again."""
import gc
import os
import shutil
import threading
import time

import pytest
import torch
from lora_files import CFG, make_pairs, write_lora
from lycoris_files import lycoris_file
from safetensors.torch import load_file, save_file
from test_lora_rows import engine, job, rel_err, sequential

from engine import InputError
from engine.features.lora import LoRAFile
from engine.features.lora import rows as rows_module
from engine.serve import Batcher, Job

WAIT = 60
H = CFG.hidden_size
BLOCKS = ["layers.0.self_attention.to_q", "layers.0.mlp.gate_proj", "layers.1.mlp.linear_fc2",
          "layers.1.self_attention.to_out.0"]


def held_bytes() -> int:
    """The bytes of LoRA data alive in this process (LoRAFile tensors that hold data, not a header's meta)."""
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, LoRAFile):
            for e in obj.entries.values():
                parts = [e.up, e.down, e.diff] + (list(e.lycoris.t.values()) if e.lycoris is not None else [])
                total += sum(t.numel() * t.element_size() for t in parts if t is not None and not t.is_meta)
    return total


def plain(i, steps=2, **kw):
    """A job of one row (cfg 1)."""
    g = torch.Generator().manual_seed(i)
    return Job(latent=torch.zeros(CFG.in_channels, 4, 4), cond=torch.randn(3, CFG.text_in_dim, generator=g), uncond=None, seed=i,
               steps=steps, cfg=1.0, **kw)


class Hold:
    """An ``on_step`` that stops its job after step ``at`` until released (the batch waits with it)."""

    def __init__(self, at: int = 1):
        self.at, self.reached, self.go = at, threading.Event(), threading.Event()

    def __call__(self, step, total):
        if step == self.at:
            self.reached.set()
            assert self.go.wait(WAIT)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """16 LoRA files of rank 16 on four block linears (fp32)."""
    d = tmp_path_factory.mktemp("lora_cache")
    return [write_lora(d / f"l{i}.safetensors", make_pairs(BLOCKS, rank=16, seed=i), "diffusers", dtype=torch.float32)
            for i in range(16)]


def test_waiting_jobs_hold_no_lora_data_past_the_budget(many):
    """Item 3: eight jobs of two LoRAs each, one running (held), seven queued: the data alive is the budget plus the
    running job's two files, not sixteen files."""
    eng = engine()
    size = os.path.getsize(many[0])  # one file's tensors, about
    with torch.inference_mode():
        batcher = Batcher(eng, max_batch=1, lora_budget_bytes=4 * size)
        hold = Hold()
        try:
            base = held_bytes()
            futures = [batcher.submit(plain(0, steps=3, on_step=hold, lora_set=[(many[0], 1.0), (many[1], 1.0)]))]
            assert hold.reached.wait(WAIT)
            futures += [batcher.submit(plain(i, lora_set=[(many[2 * i], 0.5), (many[2 * i + 1], 0.5)])) for i in range(1, 8)]
            assert batcher.stats()["queued"] == 7
            alive = held_bytes() - base
            hold.go.set()
            for f in futures:
                f.result(WAIT)
        finally:
            hold.go.set()
            batcher.close()
    assert alive <= 4 * size + 2 * size, (alive, size)  # before: all sixteen files (16 x size)


def test_what_a_lora_costs_resident_is_known_from_its_header_and_bounded(tmp_path):
    """Item 4: a bf16 LoHa whose float32 terms, padded to the fused qkv rows, cost many times its file: refused past
    the budget by name; the predicted file and terms bytes are what is resident once used, for every kind."""
    loha = lycoris_file(tmp_path / "loha.safetensors", "loha", ["layers.0.self_attention.to_q"], seed=1)[0]
    shrunk = {k: v.to(torch.bfloat16) for k, v in load_file(loha).items()}
    save_file(shrunk, loha)
    eng = engine()
    with torch.inference_mode():
        probe = Batcher(eng)
        try:
            cost = probe.loras.entry(loha)
        finally:
            probe.close()
        assert cost.terms_cost > 4 * cost.file_cost  # float32, [3 H, r1 r2] for one of three parts
        batcher = Batcher(eng, lora_budget_bytes=2 * cost.file_cost)
        try:
            with pytest.raises(InputError, match=r"loras: LoRA loha.safetensors needs .* resident .* budget of .* "
                                                 r"\(sgld serve --lora-cache-mb\)"):
                batcher.submit(plain(0, lora_set=[(loha, 1.0)]))
        finally:
            batcher.close()
        kinds = {"lora": write_lora(tmp_path / "lora.safetensors", make_pairs(BLOCKS, seed=2), "kohya", alpha=2.0),
                 "lokr": lycoris_file(tmp_path / "lokr.safetensors", "lokr_decomposed", BLOCKS, seed=3)[0],
                 "loha": loha, "diff": _diff_file(tmp_path / "diff.safetensors", (H, H))}
        batcher = Batcher(eng, max_batch=8)
        try:
            for f in batcher.submit_many([plain(i, lora_set=[(p, 1.0)]) for i, p in enumerate(kinds.values())]):
                f.result(WAIT)
            for name, path in kinds.items():
                entry = batcher.loras.entry(path)
                assert entry.modules and entry.terms_bytes == entry.terms_cost, name
                assert entry.lf.nbytes == entry.file_cost, name
        finally:
            batcher.close()


def _counting(monkeypatch, delay: float = 0.0):
    """Every read_lora the cache makes: [(path, header_only)] (a full read sleeps ``delay`` s, widening races)."""
    calls, real = [], rows_module.read_lora

    def read(source, model, header_only=False):
        calls.append((os.path.basename(str(source)), header_only))
        if not header_only:
            time.sleep(delay)
        return real(source, model, header_only=header_only) if header_only else real(source, model)
    monkeypatch.setattr(rows_module, "read_lora", read)
    return calls


def test_one_file_named_at_once_is_read_once_and_is_one_lora(many, monkeypatch):
    """Item 5: six requests naming one file at once: one full read, one entry; their jobs share one forward under
    --max-loras-per-forward 1."""
    calls = _counting(monkeypatch, delay=0.3)
    eng = engine()
    with torch.inference_mode():
        batcher = Batcher(eng, max_batch=8, max_loras=1)
        try:
            barrier = threading.Barrier(6)

            def request(i):
                barrier.wait()
                return batcher.check_loras([(many[5], 1.0)])
            threads = [threading.Thread(target=request, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT)
            assert [c for c in calls if not c[1]] == [("l5.safetensors", False)]
            assert batcher.loras.metrics()["cached"] == 1
            futures = batcher.submit_many([plain(i, lora_set=[(many[5], 1.0)]) for i in range(4)])
            for f in futures:
                f.result(WAIT)
            assert batcher.stats()["samples_per_forward"] == 4  # before: one entry each, four forwards in turn
        finally:
            batcher.close()


def test_a_lora_past_the_budget_is_refused_before_its_data_is_read(many, monkeypatch):
    """Item 6: decided from the header (dtypes x shapes): no full read."""
    calls = _counting(monkeypatch)
    eng = engine()
    with torch.inference_mode():
        batcher = Batcher(eng, lora_budget_bytes=os.path.getsize(many[6]) // 2)
        try:
            with pytest.raises(InputError, match="l6.safetensors needs .* budget"):
                batcher.check_loras([(many[6], 1.0)])
        finally:
            batcher.close()
    assert ("l6.safetensors", False) not in calls


def _diff_file(path, stored_shape, seed=4, layer="layers.1.self_attention.to_out.0"):
    g = torch.Generator().manual_seed(seed)
    save_file({f"diffusion_model.{layer}.diff": torch.randn(H * H, generator=g).reshape(stored_shape) * 0.02},
              str(path))
    return str(path)


@pytest.mark.parametrize("stored", [(H // 2, 2 * H), (H * H,)], ids=["halves", "flat"])
def test_a_diff_stored_in_another_shape_runs_beside_other_requests(tmp_path, many, stored):
    """Item 7: a full .diff of the layer's size in another shape: the batch it shares runs, each job equal to its
    own sequential run with its LoRA merged."""
    diff = _diff_file(tmp_path / "diff.safetensors", stored)
    eng = engine()
    sets = [[(diff, 1.0)], [(many[7], 0.8)], []]
    with torch.inference_mode():
        refs = [sequential(eng, job(i), s) for i, s in enumerate(sets)]
        batcher = Batcher(eng, max_batch=16)
        try:
            got = [f.result(WAIT) for f in batcher.submit_many([job(i, s) for i, s in enumerate(sets)])]
            assert batcher.stats()["samples_per_forward"] == 6
        finally:
            batcher.close()
    for i, (g, r) in enumerate(zip(got, refs)):
        assert rel_err(g, r) <= 1e-5, (i, rel_err(g, r))


def test_a_lora_that_cannot_be_made_ready_fails_only_its_job(tmp_path, many):
    """Item 7: B's file, evicted while B waited, is replaced before B's first forward: B fails naming it; A, which
    shares that forward, goes on and gets exactly its latent alone."""
    b = shutil.copy(many[9], tmp_path / "b.safetensors")
    eng = engine()
    with torch.inference_mode():
        alone = Batcher(eng, max_batch=8)
        try:
            want = alone.submit(plain(1, steps=3, lora_set=[(many[8], 1.0)])).result(WAIT)
            budget = alone.loras.entry(many[8]).cost + alone.loras.entry(b).file_cost // 2  # A's, not B's data too
        finally:
            alone.close()
        batcher = Batcher(eng, max_batch=8, lora_budget_bytes=budget)
        hold = Hold()
        try:
            a = batcher.submit(plain(1, steps=3, on_step=hold, lora_set=[(many[8], 1.0)]))
            assert hold.reached.wait(WAIT)
            b_job = batcher.submit(plain(2, steps=3, lora_set=[(b, 1.0)]))
            assert batcher.loras.entry(b).lf is None  # evicted: A's LoRA is resident
            write_lora(b, make_pairs(BLOCKS, rank=16, seed=99), "diffusers", dtype=torch.float32)
            hold.go.set()
            got = a.result(WAIT)
            with pytest.raises(InputError, match="b.safetensors: the file was replaced"):
                b_job.result(WAIT)
        finally:
            hold.go.set()
            batcher.close()
    assert torch.equal(got, want)


def test_jobs_pass_a_job_waiting_for_lora_room_a_bounded_number_of_times(many):
    """Item 8: A holds the one LoRA slot for a long run; B needs another LoRA; plain jobs behind B run beside A
    (before: they all waited for A's whole run), at most --max-batch (3) of them: the rest wait behind B."""
    eng = engine()
    ended = {}
    with torch.inference_mode():
        batcher = Batcher(eng, max_batch=3, max_loras=1)
        hold = Hold()
        try:
            a = batcher.submit(plain(0, steps=400, on_step=hold, lora_set=[(many[10], 1.0)]))
            assert hold.reached.wait(WAIT)  # A runs: B and the Cs are queued behind it in order
            b = batcher.submit(plain(1, lora_set=[(many[11], 1.0)]))
            cs = batcher.submit_many([plain(2 + i) for i in range(5)])
            for name, f in [("a", a), ("b", b)] + [(f"c{i}", c) for i, c in enumerate(cs)]:
                f.add_done_callback(lambda _, name=name: ended.setdefault(name, time.monotonic()))
            hold.go.set()
            for f in [a, b, *cs]:
                f.result(WAIT)
        finally:
            hold.go.set()
            batcher.close()
    assert all(ended[f"c{i}"] < ended["a"] for i in range(3)), ended  # two beside A, then one more: three passes
    assert all(ended[f"c{i}"] > ended["a"] for i in (3, 4)), ended  # then nothing passes B
    assert ended["b"] > ended["a"]


def test_aliases_of_one_file_are_one_lora(tmp_path, many):
    """Item 9: a symlink, a hard link and another spelling of one file, each named once, are one file named
    twice: refused (before: applied together, strengths summed past the bound)."""
    a = shutil.copy(many[12], tmp_path / "a.safetensors")
    os.symlink(a, tmp_path / "link.safetensors")
    os.link(a, tmp_path / "hard.safetensors")
    eng = engine()
    with torch.inference_mode():
        batcher = Batcher(eng)
        try:
            for alias in ("link.safetensors", "hard.safetensors", "./a.safetensors", "..//" + tmp_path.name + "/a.safetensors"):
                with pytest.raises(InputError, match="LoRA a.safetensors is named twice"):
                    batcher.check_loras([(a, 100.0), (str(tmp_path / alias), 100.0)])
        finally:
            batcher.close()


def test_a_file_replaced_with_its_times_kept_is_read_again(tmp_path, many):
    """Item 11: ``cp -p`` of another LoRA of the same size over a cached one: the new content, in the per-request
    cache and in the engine's own (Engine.set_loras)."""
    a, other = tmp_path / "a.safetensors", tmp_path / "other.safetensors"
    shutil.copy(many[13], a)
    shutil.copy(many[14], other)
    stamp = time.time() - 100
    for p in (a, other):
        os.utime(p, (stamp, stamp))
    eng = engine()
    with torch.inference_mode():
        batcher = Batcher(eng)
        try:
            first = batcher.loras.read(str(a))
            engine_first = eng.runner.lora_files.read(str(a), eng.model)
            time.sleep(0.05)
            shutil.copy2(other, a)  # cp -p: the same size and mtime
            second = batcher.loras.read(str(a))
            engine_second = eng.runner.lora_files.read(str(a), eng.model)
        finally:
            batcher.close()
    for old, new in ((first, second), (engine_first, engine_second)):
        assert not torch.equal(old.entries[BLOCKS[0]].up, new.entries[BLOCKS[0]].up)


def test_admission_by_bytes_counts_the_loras_terms(many):
    """Item 4, on a GPU's admission by bytes (the room set here as a card's would be): B's activations fit beside
    A's, its LoRA's terms do not: B waits for memory (before: admitted, its terms outside the count)."""
    eng = engine()
    with torch.inference_mode():
        probe = Batcher(eng)
        try:
            terms = probe.loras.entry(many[15]).terms_cost
        finally:
            probe.close()
        batcher = Batcher(eng, max_batch=8)
        batcher.activation_room = 1  # a card: every job's activations counted
        working = batcher._prepare(plain(0, steps=1)).working  # one job's (not queued)
        batcher.activation_room = 2 * working + terms + terms // 2  # two jobs and one LoRA's terms, not two
        hold = Hold()
        try:
            a = batcher.submit(plain(1, steps=3, on_step=hold, lora_set=[(many[14], 1.0)]))
            assert hold.reached.wait(WAIT)
            b = batcher.submit(plain(2, steps=3, lora_set=[(many[15], 1.0)]))
            time.sleep(0.2)
            assert batcher.stats()["queued"] == 1 and batcher.stats()["waited_for_memory"] == 1
            hold.go.set()
            a.result(WAIT)
            b.result(WAIT)
        finally:
            hold.go.set()
            batcher.close()


def test_a_forwards_loras_replace_the_last_ones_within_the_budget(many, monkeypatch):
    """Item 3, inside a forward: the last forward's resident LoRAs leave before this one's are made resident, so the
    cache's bytes never pass the budget while they change (before: both forwards' terms at once)."""
    eng = engine()
    seen = []
    real = rows_module.RowLoRAs._install

    def install(self, entry):
        real(self, entry)
        seen.append(self.metrics()["bytes"])
    monkeypatch.setattr(rows_module.RowLoRAs, "_install", install)
    with torch.inference_mode():
        probe = Batcher(eng)
        try:
            budget = 2 * max(probe.loras.entry(p).cost for p in many[:4]) + 1
        finally:
            probe.close()
        batcher = Batcher(eng, max_batch=1, lora_budget_bytes=budget)
        try:
            for i in range(2):
                batcher.submit(plain(i, lora_set=[(many[2 * i], 1.0), (many[2 * i + 1], 1.0)])).result(WAIT)
        finally:
            batcher.close()
    assert len(seen) == 4 and max(seen) <= budget, (seen, budget)
