"""`sgld serve` against an attacker (issue 25), as a real server process: slow and idle connections are
closed (raw sockets, one-second bounds set by flags), the connection cap holds, bodies that are no
safetensors or no JSON the server wants are 400s (never a 500), LoRA bookkeeping stays bounded, a LoRA
that cannot fit the model is refused from its header (its 2 GiB of data never read), and SIGTERM ends a
running /v1/sample stream with its 503 line."""
from __future__ import annotations

import http.client
import json
import select
import signal
import socket
import struct
import time

import psutil
import pytest
import requests
import torch
from safetensors.torch import save
from test_serve import LONG, Server, demo_lora

pytestmark = [pytest.mark.server]

BOUND_S = 1.0  # --header-timeout, --body-timeout, --keep-alive-timeout of the module's server
MAX_CONNECTIONS = 4
WAIT_S = 6.0  # how long a test waits for the server to close a connection (old code: never)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    demo_lora(folder / "style.safetensors")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora_dir):
    s = Server(tmp_path_factory.mktemp("hard") / "serve.log", "--lora-dir", str(lora_dir),
               "--header-timeout", str(BOUND_S), "--body-timeout", str(BOUND_S),
               "--keep-alive-timeout", str(BOUND_S), "--max-connections", str(MAX_CONNECTIONS))
    yield s.wait_ready()
    assert s.stop() == 0, s.log()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)


def until_closed(sock: socket.socket, piece: bytes = b"", every: float = 0.2) -> bytes:
    """Sends ``piece`` every ``every`` s (nothing: just waits) until the server closes the connection;
    everything it answered. Fails if it is still open after WAIT_S."""
    got, deadline = b"", time.monotonic() + WAIT_S
    try:
        while time.monotonic() < deadline:
            if select.select([sock], [], [], every)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return got
                got += chunk
            elif piece:
                sock.sendall(piece)
    except (ConnectionResetError, BrokenPipeError):
        return got
    finally:
        sock.close()
    raise AssertionError(f"the server kept the connection open for {WAIT_S} s (answered {got[:200]!r})")


def error_code(answer: bytes) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    return json.loads(body)["error"]["code"]


# -- item 2: slow and idle connections, the connection cap -----------------------------------------------------
def test_headers_trickled_get_408(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    answer = until_closed(sock, b"X-Slow: 1\r\n")
    assert answer.startswith(b"HTTP/1.1 408") and error_code(answer) == "request_timeout", answer
    assert b"--header-timeout" in answer
    assert server.healthy()


def test_an_idle_socket_is_closed(server):
    answer = until_closed(connect(server))  # connected, nothing sent
    assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_body_trickled_gets_408(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    answer = until_closed(sock, b" ")
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer
    assert server.metric("sgld_requests_total", endpoint="/v1/images/generations", status="408") >= 1
    assert server.healthy()


def test_an_idle_kept_alive_connection_is_closed(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}'), answer


def test_a_kept_alive_connection_has_the_header_clock_again(server):
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n")  # the second never ends
    answer = until_closed(sock, b"X-Slow: 1\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in answer, answer


def test_connections_past_the_cap_get_503(server):
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each is open (a request on it would be served)
            assert not select.select([sock], [], [], 0)[0]
        answer = until_closed(connect(server))
        assert answer.startswith(b"HTTP/1.1 503") and error_code(answer) == "too_many_connections", answer
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + WAIT_S
    while True:  # the server sees the closes at once
        try:
            assert server.healthy()
            break
        except requests.ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


# -- item 6: /v1/sample bodies that are safetensors in name only --------------------------------------------------
def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def sample_body(settings=None, **tensors) -> bytes:
    tensors = tensors or {"latent": torch.zeros(48, 16, 16), "cond": torch.zeros(4, 128)}
    return save(tensors, metadata={"sgld": json.dumps(settings or {"seed": 0, "steps": 2, "cfg": 1.0})})


TENSORS = {"latent": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
           "cond": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}


@pytest.mark.parametrize("metadata", [["sgld"], "sgld", 3, None])
def test_sample_metadata_that_is_no_object_is_400(server, metadata):
    r = requests.post(server.base + "/sample", data=safetensors_bytes({"__metadata__": metadata, **TENSORS}, bytes(8)),
                      timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_body" and "'__metadata__' must be a JSON object" in r.text


def test_sample_header_too_large_is_called_so(server):
    header = {"__metadata__": {"pad": "x" * 100_500}, **TENSORS}
    r = requests.post(server.base + "/sample", data=safetensors_bytes(header, bytes(8)), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body", r.text
    message = r.json()["error"]["message"]
    assert "more than the 100000" in message and "pickle" not in message, message


# -- item 7: JSON bodies -------------------------------------------------------------------------------------------
DEEP = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"  # 200 kB, under --max-body-bytes


@pytest.mark.parametrize("path", ["/v1/images/generations", "/v1/set_lora", "/v1/unset_lora"])
@pytest.mark.parametrize("body,words", [(DEEP, "not valid JSON"), ('{"prompt": "a", "prompt": "b"}', "appears twice"),
                                        ('{"lora_nickname": "a", "lora_nickname": "b"}', "appears twice")],
                         ids=["deep", "duplicate-prompt", "duplicate-nickname"])
def test_json_bodies_one_rule_everywhere(server, path, body, words):
    r = requests.post(server.url + path, data=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json" and words in r.json()["error"]["message"], r.text
    assert server.healthy()


@pytest.mark.parametrize("size", ["６４x６４", "64x64\n", " 64x64", "64 x 64", "٦٤x٦٤"])
def test_size_is_ascii_wxh_only(server, size):
    r = server.post("/v1/images/generations", {"prompt": "x", "size": size, "num_inference_steps": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text


def test_head_health_is_200(server):
    r = requests.head(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""


# -- item 11: the LoRA bookkeeping is bounded ------------------------------------------------------------------
def test_lora_nicknames_are_bounded(server):
    r = server.post("/v1/set_lora", {"lora_nickname": "n" * 65, "lora_path": "style.safetensors"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_nickname" and "64" in r.text
    assert "n" * 65 not in r.text
    r = server.post("/v1/set_lora", {"lora_nickname": [f"a{i}" for i in range(9)], "lora_path": ["style.safetensors"] * 9})
    assert r.status_code == 400 and "at most 8" in r.text
    for i in range(70):
        r = server.post("/v1/set_lora", {"lora_nickname": f"nick{i:02d}", "lora_path": "style.safetensors", "strength": 0.1})
        assert r.status_code == 200, r.text
    listing = requests.get(server.base + "/list_loras", timeout=10).json()
    known = [a["nickname"] for a in listing["loaded_adapters"]]
    assert len(known) == 64 and known[-1] == "nick69" and "nick00" not in known
    assert [a["nickname"] for a in listing["active"]["transformer"]] == ["nick69"]
    assert server.post("/v1/set_lora", {"lora_nickname": "nick10"}).status_code == 200  # remembered: by nickname
    r = server.post("/v1/set_lora", {"lora_nickname": "nick00"})  # forgotten: its path is asked for again
    assert r.status_code == 400 and "not loaded" in r.text
    assert server.post("/v1/unset_lora").status_code == 200


# -- item 4: SIGTERM ends a running /v1/sample stream with its 503 line ------------------------------------------
def test_sigterm_ends_a_sample_stream_with_its_503_line(tmp_path):
    s = Server(tmp_path / "term.log", "--shutdown-grace", "1").wait_ready()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/sample", body=sample_body({"seed": 0, "steps": LONG, "cfg": 1.0}))
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.readline()) == {"step": 1, "total": LONG}
        s.proc.send_signal(signal.SIGTERM)
        rest = response.read().decode()  # the whole chunked body (a cut one raises IncompleteRead)
        conn.close()
        last = json.loads([line for line in rest.splitlines() if line.strip()][-1])
        assert last["status"] == 503 and last["error"]["code"] == "shutting_down", last
        assert s.proc.wait(60) == 0
    finally:
        s.stop()
    assert "Traceback" not in s.log() and "CancelledError" not in s.log(), s.log()


# -- item 5: a LoRA that cannot fit the model is refused from its header ------------------------------------------
def sparse_lora(path, rank: int = 2, width: int = 2 ** 28) -> str:
    """down [rank, width] float32 (2 GiB at the default: holes, no disk) and up [384, rank] on the demo's to_q."""
    name = "diffusion_model.layers.0.self_attention.to_q"
    up, down = 384 * rank * 4, rank * width * 4
    header = {f"{name}.lora_up.weight": {"dtype": "F32", "shape": [384, rank], "data_offsets": [0, up]},
              f"{name}.lora_down.weight": {"dtype": "F32", "shape": [rank, width], "data_offsets": [up, up + down]}}
    raw = safetensors_bytes(header)
    with open(path, "wb") as f:
        f.write(raw)
        f.truncate(len(raw) + up + down)
    return str(path)


def test_a_lora_of_other_shapes_is_refused_before_its_data_is_read(server, lora_dir):
    sparse_lora(lora_dir / "huge.safetensors")
    process = psutil.Process(server.proc.pid)
    read_before = process.io_counters().read_chars
    r = server.post("/v1/set_lora", {"lora_nickname": "huge", "lora_path": "huge.safetensors"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_lora" and "another size" in error["message"], error
    assert process.io_counters().read_chars - read_before < 16 << 20  # the header, not the 2 GiB
    assert requests.get(server.base + "/list_loras", timeout=10).json()["active"]["transformer"] == []
    assert server.healthy()
