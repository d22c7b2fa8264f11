"""`sgld serve --ray` (engine/serve/ray_app.py) on a real Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``: a head and a second raylet, one CPU each, so each engine replica has a node of its
own), started and stopped here; the client is the `openai` SDK. Both replicas make `sgld generate`'s picture; a LoRA
change reaches both; requests naming a LoRA go back to the replica that holds it (Serve's multiplexed ids);
/metrics sums the replicas; a replica killed (SIGKILL) mid-run loses no request and is replaced; SIGTERM drains and
exits 0. The quick tier without ray skips with the reason; CI installs it (requirements-dev.txt)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import requests
from test_serve import Server, free_port
from test_serve_replicas import (
    STEPS,  # the killed replica's runs: long enough to be in flight when it dies
    a_lora_change_reaches_every_replica,
    answered_through_a_kill,
    ask,
    from_both,
    generated,
    health,
    lora_folder,
)

pytest.importorskip("ray", reason="ray is the [cluster] extra (pip install '.[cluster]'); CI installs it")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.server]
ORDER_COST = 100  # seconds on the 2-core machine (a two-node Ray cluster, a deployment, a kill and its replacement): queued early (tests/conftest.py)
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    base = tmp_path_factory.mktemp("ray")
    loras = lora_folder(base)
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        server = Server(base / "front.log", "--ray", cluster.address, "--dp-size", "2", "--lora-dir", loras)
        try:
            deadline = time.monotonic() + 300
            while "sgld serve: 2 replicas on Ray" not in server.log():  # the start line: every replica is up
                assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
                time.sleep(0.3)
            while len(health(server)["replicas"]) < 2:
                assert time.monotonic() < deadline, server.last_health
                time.sleep(0.2)
            yield server
        finally:
            assert server.stop() == 0, server.log()
    finally:
        cluster.shutdown()


def test_both_replicas_on_their_nodes_make_sgld_generates_picture(front, tmp_path, sgld_in_process):
    want = generated(sgld_in_process, tmp_path / "ref.png")
    state = health(front)
    assert state["status"] == "ok" and [r["index"] for r in state["replicas"]] == [0, 1], state
    assert len({r["node"] for r in state["replicas"]}) == 2 and len({r["pid"] for r in state["replicas"]}) == 2, state
    assert all(np.array_equal(picture, want) for picture, _ in from_both(front, 4))


def test_a_lora_change_reaches_every_replica_and_lora_requests_keep_their_replica(front):
    a_lora_change_reaches_every_replica(front)  # each replica makes the change before its next request
    homes = {"a.safetensors": [], "b.safetensors": []}  # files of --lora-dir
    for name in homes:
        homes[name].append(ask(front, 6, loras=[name])[1])
    time.sleep(2.0)  # Serve's router learns which replica holds which LoRA set from its controller
    for name in list(homes) * 3:  # one at a time: nothing in flight, so the LoRAs decide
        homes[name].append(ask(front, 6, loras=[name])[1])
    assert all(len(set(h)) == 1 for h in homes.values()), homes
    metrics = requests.get(front.url + "/metrics", timeout=10).text
    images = sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("sgld_images_total "))
    served = [r["served"] for r in health(front)["replicas"]]  # each replica's own count of the pictures it made
    assert images == sum(served) and min(served) > 0 and "sgld_replicas_up 2" in metrics, (served, metrics[-2000:])


def test_a_killed_replica_loses_no_request_and_is_replaced(front):
    seeds = list(range(20, 32))  # 4 at a time until both replicas hold work
    answers, victim = answered_through_a_kill(front, seeds)
    deadline = time.monotonic() + 120
    while len([r for r in health(front)["replicas"] if r["pid"] != victim]) < 2:
        assert time.monotonic() < deadline, front.last_health
        time.sleep(0.2)
    state = front.last_health
    assert state["retried"] >= 1 and state["restarts"] >= 1 and state["last_replacement_s"] > 0, state
    again = [ask(front, s, STEPS)[0] for s in seeds[:2]]  # the same seeds now: the same pictures
    assert all(np.array_equal(a, b[0]) for a, b in zip(again, answers))


def test_ray_flags_are_checked_before_anything_starts(sgld_in_process):
    """The connection bounds are the HTTP server's, which under --ray is Ray's proxy: refused by name."""
    code, _, err = sgld_in_process("serve", "--ray", "--max-connections", "5", "--port", "0")
    assert code == 2 and "--max-connections" in err and "--ray" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = sgld_in_process("serve", "--ray", "--ray-autoscale", "3:1", "--port", "0")
    assert code == 2 and "--ray-autoscale" in err, err
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens: Ray alone would retry for minutes
    code, _, err = sgld_in_process("serve", "--ray", nowhere, "--port", "0")
    assert code == 2 and f"--ray {nowhere}: no Ray cluster answers there" in err and len(err.strip().splitlines()) == 1, err


def test_the_kuberay_example_names_this_application_and_flags_it_accepts(tmp_path):
    """deploy/rayservice.yaml (written, not run here): its import path is the application builder, its flags parse
    as `sgld serve`'s, and the builder checks them (and the model's files) before anything deploys."""
    import shlex

    import yaml

    from engine.cli import serve as serve_cli

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy",
                           "rayservice.yaml")) as f:
        service = yaml.safe_load(f)
    assert service["kind"] == "RayService"
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    module, _, name = app["import_path"].partition(":")
    assert module == "engine.cli.serve" and getattr(serve_cli, name) is serve_cli.ray_application
    args = serve_cli._parsed(["serve", *shlex.split(app["args"]["flags"]), "--ray",
                              "--dp-size", app["args"]["replicas"]], devices_here=False)  # a head without GPUs
    assert args.device == "cuda" and args.dp_size == 2 and args.lora_dir == "/models/loras"
    with pytest.raises(ValueError, match="ERNIE-Image-Turbo"):  # the weights are not on this machine
        serve_cli.ray_application(app["args"])
