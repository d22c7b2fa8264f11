"""`sgld serve --dp-size 2` (engine/serve/replicas.py, front.py) as real processes: a front and two replica servers
of the demo model, asked through the `openai` SDK. Both replicas make `sgld generate`'s picture; requests spread over
them; a LoRA change reaches both; requests naming a LoRA go back to the replica that served it; /metrics sums the
replicas; a replica killed (SIGKILL) in the middle of a run loses no request (each answered with the picture its
seed makes) and is started again; the front's SIGTERM stops everything with exit 0."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from PIL import Image
from test_serve import PROMPTS, Server, client, demo_lora, pixels

pytestmark = [pytest.mark.server]
ORDER_COST = 50  # seconds on the 2-core machine (replica processes, a kill and its replacement): queued early (tests/conftest.py)
STEPS = 100  # the killed replica's runs: long enough to be in flight when it dies (about 1 s each, one thread)


def lora_folder(base):
    """``base``/loras with the demo LoRAs a (0.5) and b (-0.5): the --lora-dir of the replica tests."""
    (base / "loras").mkdir()
    demo_lora(base / "loras" / "a.safetensors", scale=0.5)
    demo_lora(base / "loras" / "b.safetensors", scale=-0.5)
    return str(base / "loras")


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    base = tmp_path_factory.mktemp("replicas")
    server = Server(base / "front.log", "--dp-size", "2", "--lora-dir", lora_folder(base)).wait_ready()
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log()
        pids = [r["pid"] for r in server.last_health["replicas"]] if hasattr(server, "last_health") else []
        for pid in pids:  # the replicas ended with the front
            assert not _alive(pid), pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def health(front) -> dict:
    front.last_health = requests.get(front.url + "/health", timeout=10).json()
    return front.last_health


def ask(front, seed: int, steps: int = 12, loras=None, prompt: str = PROMPTS[0]):
    """(picture, the replica that answered) of one request through the SDK."""
    extra = {"seed": seed, "num_inference_steps": steps}
    if loras:
        extra["loras"] = [{"name": n, "strength": 1.0} for n in loras]
    raw = client(front).images.with_raw_response.generate(model="sgld-demo", prompt=prompt, size="64x64",
                                                         response_format="b64_json", extra_body=extra)
    return pixels(raw.parse().data[0].b64_json), int(raw.headers["x-sgld-replica"])


def generated(sgld_in_process, path, seed: int = 4, steps: int = 12):
    """`sgld generate`'s picture of ``PROMPTS[0]`` (the replicas are to make it)."""
    code, _, err = sgld_in_process("generate", "--prompt", PROMPTS[0], "--seed", seed, "--steps", steps, "--out", path)
    assert code == 0, err
    return np.asarray(Image.open(path).convert("RGB"))


def answered_through_a_kill(front, seeds):
    """(the answers to the long requests sent, in the order of ``seeds``, 4 at once until every replica holds work;
    the pid of replica 0, SIGKILLed then). Serve's router may put 4 on one replica; the front here spreads them."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = []
        for start in range(0, len(seeds), 4):
            futures += [pool.submit(ask, front, s, STEPS) for s in seeds[start:start + 4]]
            deadline = time.monotonic() + 10
            while not all(r["in_flight"] for r in health(front)["replicas"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if all(r["in_flight"] for r in front.last_health["replicas"]):
                break
        else:
            raise AssertionError(f"{len(futures)} requests never kept both replicas busy: {front.last_health}")
        victim = front.last_health["replicas"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        return [f.result(timeout=300) for f in futures], victim


def test_both_replicas_make_sgld_generates_picture(front, tmp_path, sgld_in_process):
    want = generated(sgld_in_process, tmp_path / "ref.png")
    state = health(front)
    assert state["status"] == "ok" and [r["status"] for r in state["replicas"]] == ["up", "up"]
    assert len({r["pid"] for r in state["replicas"]}) == 2
    answers = from_both(front, 4)
    assert all(np.array_equal(picture, want) for picture, _ in answers)


def from_both(front, seed: int, rounds: int = 4) -> list:
    """(picture, replica) of rounds of 4 requests at once, until both replicas have answered (the least busy takes
    each; Serve's router, on queue lengths it caches, may put a round on one replica)."""
    answers = []
    for _ in range(rounds):
        with ThreadPoolExecutor(4) as pool:
            answers += pool.map(lambda _: ask(front, seed), range(4))
        if {replica for _, replica in answers} == {0, 1}:
            return answers
    raise AssertionError(f"{len(answers)} requests all went to replica {answers[0][1]}: {health(front)}")


def a_lora_change_reaches_every_replica(front) -> None:
    """/v1/set_lora, then requests until both replicas answered: each with the LoRA's picture; after
    /v1/unset_lora the plain picture again."""
    plain = ask(front, 5)[0]
    r = requests.post(front.url + "/v1/set_lora", json={"lora_nickname": "a", "lora_path": "a.safetensors"}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        both = from_both(front, 5)  # each replica runs with the LoRA on
        assert all(np.array_equal(p, both[0][0]) for p, _ in both) and not np.array_equal(both[0][0], plain)
    finally:
        r = requests.post(front.url + "/v1/unset_lora", json={}, timeout=60)
        assert r.status_code == 200, r.text
    assert np.array_equal(ask(front, 5)[0], plain)


def test_a_lora_change_reaches_every_replica_and_lora_requests_keep_their_replica(front):
    a_lora_change_reaches_every_replica(front)
    homes = {"a.safetensors": set(), "b.safetensors": set()}  # files of --lora-dir
    for name in list(homes) * 3:  # one at a time: nothing in flight, so the LoRAs decide
        homes[name].add(ask(front, 6, loras=[name])[1])
    assert [len(h) for h in homes.values()] == [1, 1] and len(set.union(*homes.values())) == 2, homes
    metrics = requests.get(front.url + "/metrics", timeout=10).text
    served = sum(r["served"] for r in health(front)["replicas"])
    assert f"sgld_images_total {float(served)!r}" in metrics and "sgld_replicas_up 2" in metrics


def test_a_killed_replica_loses_no_request(front):
    seeds = list(range(20, 24))
    answers, victim = answered_through_a_kill(front, seeds)
    assert [replica for _, replica in answers].count(1) >= 3  # what replica 0 held was sent again to replica 1
    deadline = time.monotonic() + 120
    while health(front)["replicas"][0]["status"] != "up":
        assert time.monotonic() < deadline, front.last_health
        time.sleep(0.2)
    state = front.last_health
    assert state["replicas"][0]["pid"] != victim and state["replicas"][0]["restarts"] == 1
    assert state["retried"] >= 1 and state["last_replacement_s"] > 0
    again = ask(front, seeds[0], STEPS)[0]  # the same seed now: the same picture
    assert np.array_equal(again, answers[0][0])
    assert "sgld_replica_restarts_total 1" in requests.get(front.url + "/metrics", timeout=10).text



def test_a_sample_stream_through_the_front_and_one_whose_replica_dies(front):
    """The remote KSampler's stream (/v1/sample) passes through whole; one whose replica is killed mid-run ends with
    a last 503 line naming why, and the replica is being started again."""
    from test_serve_limits import sample_body

    from engine.sample_wire import decode_latent

    def stream(steps):
        r = requests.post(front.url + "/v1/sample", data=sample_body({"seed": 3, "steps": steps, "cfg": 1.0}),
                          stream=True, timeout=300)
        return r, (json.loads(line) for line in r.iter_lines() if line.strip())

    r, lines = stream(6)
    last = list(lines)[-1]
    assert r.status_code == 200 and decode_latent(last["latent"]).shape == (48, 16, 16)
    r, lines = stream(0)  # a refusal passes through as the replica wrote it
    assert r.status_code == 400 and "steps" in list(lines)[0]["error"]["message"]
    r, lines = stream(10000)  # the most steps allowed: minutes
    replica = int(r.headers["x-sgld-replica"])
    victim = health(front)["replicas"][replica]["pid"]
    next(lines)  # a progress line: the run is on
    os.kill(victim, signal.SIGKILL)
    last = list(lines)[-1]
    assert last["status"] == 503 and last["error"]["code"] == "replica_gone", last
    deadline = time.monotonic() + 30  # seen and being replaced (the kill test waits for a replacement)
    while not health(front)["replicas"][replica]["restarts"]:
        assert time.monotonic() < deadline, front.last_health
        time.sleep(0.1)

def test_a_front_checks_the_flags_and_files_once_before_starting_replicas(tmp_path, sgld_in_process):
    """One line naming the problem and exit 2, before any replica starts."""
    for flags, says in ((["--model", str(tmp_path / "missing.safetensors")], "no such file"),
                        (["--steps", "0"], "--steps"), (["--tp", "3"], "tp")):
        code, _, err = sgld_in_process("serve", "--dp-size", "2", "--port", "0", *flags)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    code, _, err = sgld_in_process("serve", "--dp-size", "0")
    assert code == 2 and "--dp-size" in err and "at least 1" in err, err


def test_the_replayed_lora_changes_stay_bounded():
    """Switching every LoRA off makes the changes before it moot: a replacement replays from there."""
    from engine.serve.replicas import Replicas

    r = Replicas([], 0, [], timeout=1.0, max_connections=1)
    try:
        for name in ("a", "b"):
            r.record_change("/v1/set_lora", json.dumps({"lora_nickname": name, "lora_path": name}).encode())
        r.record_change("/v1/unset_lora", b'{"lora_nickname": "a"}')
        assert len(r.lora_changes) == 3
        r.record_change("/v1/unset_lora", b"")
        assert r.lora_changes == [("/v1/unset_lora", b"")]
    finally:
        r.close()
