"""`sgld serve`: the OpenAI-compatible image server (engine/serve) for the demo model or ERNIE-Image files,
under uvicorn. SIGTERM: stop listening, let the running requests finish for --shutdown-grace seconds,
cancel the rest, stop the batcher and the engine's workers, exit 0."""
from __future__ import annotations

import argparse
import functools
import os
import shlex
import signal
import socket
import sys
import threading

import torch

from .. import device as device_rt
from ..features.cache import resolve_config
from ..image_parts import NoParts
from ..models import family_of
from ..release import dit_family, picture_shift
from ..router import open_engine
from ..sampling import DEFAULT_SHIFT
from ..sampling_options import from_flags
from .common import (
    add_cache_arguments,
    add_engine_arguments,
    add_pe_arguments,
    add_release_arguments,
    add_sampling_arguments,
    add_text_encoder_arguments,
    cache_config,
    check_common_args,
    check_pe_args,
    engine_config,
    file_families,
    load_prompt_enhancer,
    use_threads,
)
from .generate import (
    LoadedModel,
    args_bundle,
    bundled_dit,
    lora_specs,
    make_parts,
    model_files,
    model_source,
    release_around,
    release_of,
    release_shift,
    uses_files,
)
from .ray_cluster import RAY_REFUSED, Stopped, last_line, ray_autoscale, ray_parts, reachable

try:  # the HTTP server's packages are an extra (pip install '.[serve]'): without them the other commands still run
    import uvicorn

    from ..serve import ServedModel, ServeSettings, create_app
    from ..serve.batcher import Batcher
    from ..serve.connections import bounded_h11
    from ..serve.front import LocalReplicas, create_front_app
    from ..serve.replicas import Replicas, end_with_front
    MISSING = None
except ImportError as e:
    if (e.name or "").split(".")[0] not in ("fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic"):
        raise
    MISSING = e.name

SERVED_PREFIX = "sgld-"  # a bundled model is served as sgld-<its name>: sgld-demo, sgld-demo-turbo
SAMPLING = ("steps", "cfg")  # the sampling options whose server-wide default a flag sets
INSTALL_HINT = ("pip install 'comfyui-sgldiffusion[serve]' (from the pack's folder: pip install -e '.[serve]'; "
                "bash scripts/setup.sh does it)")


def _positive(kind, low):
    def parse(text):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low} (got {text})")
        return value
    return parse


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve images over HTTP (OpenAI's Images API)",
                       description="An OpenAI-compatible image server (the embedded demo model by default).")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--api-key", default=None, help="ask for 'Authorization: Bearer KEY' (not on /health and /metrics)")
    s.add_argument("--served-model-name", default=None, help="the model's id in the API (default: sgld-demo, or the "
                                                              "--model file's name)")
    s.add_argument("--max-batch", "--max-running-steps", dest="max_batch", type=_positive(int, 1), default=8,
                   help="most samples in one DiT forward, an image with CFG counting twice (--max-running-steps: "
                        "the same bound; each running sample is one denoising step per forward)")
    s.add_argument("--max-queue", type=_positive(int, 0), default=64,
                   help="most images waiting beyond the running batch; more get 429")
    s.add_argument("--request-timeout", type=_positive(float, 0.001), default=600.0,
                   help="seconds a request may take; past it: 503 and its work cancelled")
    s.add_argument("--shutdown-grace", type=_positive(float, 0.0), default=30.0,
                   help="on SIGTERM, seconds the running requests may take to finish before they are cancelled")
    s.add_argument("--max-body-bytes", type=_positive(int, 1), default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--header-timeout", type=_positive(float, 0.001), default=10.0,
                   help="seconds a client has to send a request's headers (from its connection, or its first byte after "
                        "the previous answer); past it: 408 and the connection closed")
    s.add_argument("--body-timeout", type=_positive(float, 0.001), default=60.0,
                   help="seconds a request's whole body may take to arrive; past it: 408 and the connection closed")
    s.add_argument("--keep-alive-timeout", type=_positive(float, 0.001), default=5.0,
                   help="seconds an idle kept-alive connection stays open")
    s.add_argument("--max-connections", type=_positive(int, 1), default=512,
                   help="most open connections; past it a new one gets 503 and is closed")
    s.add_argument("--dp-size", type=_positive(int, 1), default=1,
                   help="replicas of the server behind this one (SGLang's data parallel): each its own process, "
                        "engine, queue and batcher (on GPUs its own devices: --num-gpus each); a request goes to the "
                        "least busy (one naming LoRAs: preferably to a replica that has them); a replica that dies "
                        "is started again, its unanswered requests sent to another (docs/serve.md)")
    s.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run as a Ray Serve application (pip install '.[cluster]'): --dp-size engine replicas (each "
                        "its --num-gpus GPUs or --threads CPUs) behind Ray's HTTP proxy on --host/--port; ADDRESS: "
                        "a running cluster's (ray://... or host:port), none: a Ray started on this machine")
    s.add_argument("--ray-autoscale", default=None, metavar="MIN:MAX",
                   help="with --ray: let Serve scale the engine replicas between MIN and MAX (instead of --dp-size)")
    s.add_argument("--lora-dir", default=None, help="the folder /v1/set_lora loads LoRA files from (none: no loading)")
    s.add_argument("--lora", action="append", default=[], metavar="FILE:STRENGTH", help="a LoRA active from the start")
    s.add_argument("--max-loras-per-forward", type=_positive(int, 1), default=8,
                   help="most distinct per-request LoRAs (a request's \"loras\") in one DiT forward; requests past it "
                        "wait for a forward with room")
    s.add_argument("--lora-cache-mb", type=_positive(int, 1), default=2048,
                   help="MiB of per-request LoRAs kept read and resident (least recently used out)")
    add_sampling_arguments(s.add_argument_group("defaults of a request without num_inference_steps / guidance_scale"),
                           SAMPLING)
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    ext = s.add_argument_group(f"{file_families()} files instead of the demo (--model-path, or all three of --model "
                               "--text-encoder --vae)")
    add_release_arguments(ext)
    ext.add_argument("--model", help=f"{file_families()} DiT: .safetensors file or diffusers transformer/ folder; 'demo-turbo': "
                                     "the embedded demo distilled to 8 steps at cfg 1")
    add_text_encoder_arguments(ext, "text encoder folder (HF text_encoder/)")
    ext.add_argument("--vae", help="VAE folder (HF vae/)")
    ext.add_argument("--sample-only", action="store_true",
                     help="serve the DiT alone, for POST /v1/sample (the SGLDiffusion Server nodes encode the prompt "
                          "and decode the picture in ComfyUI): no text encoder or VAE is loaded, image requests are "
                          "refused")
    add_pe_arguments(s)  # requests ask for it with "enhance_prompt": true
    add_engine_arguments(s)
    add_cache_arguments(s)


def check_serve_args(args) -> dict:
    """Every flag checked before anything loads (a --dp-size front checks them once for its replicas, and the model's
    files by their headers); returns the served defaults: the flags', else the model's."""
    engine_config(args)  # the engine's flags and the parallel degrees against each other, before loading
    resolve_config(cache_config(args))  # the --cache* flags, else SGLANG_CACHE_DIT_*: a bad value stops the start
    check_pe_args(args)
    if args.sample_only:
        given = [flag for flag, on in (("--text-encoder", args.text_encoder), ("--vae", args.vae),
                                       ("--pe", args.pe is not None),
                                       ("--text-encoder-device", args.text_encoder_device != "auto")) if on]
        if given:
            raise ValueError(f"--sample-only serves the DiT alone (POST /v1/sample): drop {', '.join(given)}")
        if release_of(args) is not None:
            release_of(args).require("transformer", why="the DiT")
        if uses_files(args):
            dit_family(model_source(args), companions=False)  # the DiT named and read from its header
    elif uses_files(args):
        model_files(args)  # the DiT, text encoder and VAE files named, the DiT's family read from its header
    return from_flags(args, model_source(args), SAMPLING)


def _dit_alone(args) -> LoadedModel:
    """--sample-only: the DiT the flags name (a release's, a file, the demo's), and no parts around it."""
    dit = model_source(args)
    engine = open_engine(dit, engine_config(args, cache=resolve_config(cache_config(args))))
    use_threads(engine, args)
    bundle, family = args_bundle(args), family_of(engine.model_config)  # the header was read by the check
    size = bundle.image_size if bundle else family.companions.default_size if family.companions else 1024
    return LoadedModel(engine, NoParts(size), dit)


def served_model(args) -> ServedModel:
    """The model the flags name, with its defaults and the --lora files active."""
    defaults = check_serve_args(args)
    release = release_of(args)
    pe = load_prompt_enhancer(args, model_source(args), release)  # resident: enhance_prompt must not wait for a load
    loaded = _dit_alone(args) if args.sample_only else make_parts(args)
    if args.loras:
        loaded.engine.set_loras(args.loras)
    if args.served_model_name or not uses_files(args):
        name = args.served_model_name or SERVED_PREFIX + _bundled_name(args)
    elif release is not None and release.kind == "hub":
        name = release.source  # the repo id, as SGLang names it
    else:
        name = os.path.splitext(os.path.basename(os.path.normpath(release.source if release else args.model)))[0]
    shift, shift_at = DEFAULT_SHIFT, None  # --sample-only: each request's own (its settings' shift, or sigmas)
    if not args.sample_only:
        shift = release_shift(args) or DEFAULT_SHIFT
        release = release_around(args)
        if release is not None and release.dynamic_shift():  # a shift per picture size (Z-Image's pipeline)
            shift_at = functools.partial(picture_shift, release, model_files(args)[1])
    return ServedModel(name, loaded.engine, loaded.parts, defaults["steps"], defaults["cfg"], loaded.model_path,
                       shift=shift, shift_at=shift_at,
                       enhance=None if pe is None else _enhancer(pe, args.pe_max_new_tokens))


def _bundled_name(args) -> str:
    """The name a bundled model's file goes by ("demo-turbo"), else its bundle's ("demo": a copy in another format)."""
    bundle = args_bundle(args)
    names = {os.path.abspath(f): n for n, f in bundle.named.items()}
    return names.get(os.path.abspath(bundled_dit(args))) or bundle.name


def _enhancer(pe, max_new_tokens):
    """(prompt, width, height, seed, stop) -> (revised prompt, seconds): the server's call into the PE."""
    def enhance(prompt: str, width: int, height: int, seed: int, stop):
        return pe.enhance([prompt], width, height, seed=seed, max_new_tokens=max_new_tokens, stop=stop)[0], pe.seconds
    return enhance


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use is a one-line error before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


def cmd_serve(args) -> None:
    if MISSING is not None:
        raise ValueError(f"the server needs fastapi, uvicorn and prometheus-client ('{MISSING}' is not installed): "
                         + INSTALL_HINT)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be from 0 to 65535 (got {args.port})")
    if args.lora_dir is not None and not os.path.isdir(args.lora_dir):
        raise ValueError(f"--lora-dir '{args.lora_dir}' is not a folder")
    end_with_front()  # a replica of a --dp-size front ends with it
    if args.ray is not None or args.ray_autoscale is not None:
        return _serve_on_ray(args)
    sock = _listen(args.host, args.port)
    if args.dp_size > 1:
        return _serve_replicas(args, sock)
    app, served = server_app(args)
    count = torch.get_num_threads()
    threads = f", {count} CPU thread{'s' if count > 1 else ''}" if served.engine.device.type == "cpu" else ""
    _run(app, args, sock, f"{served.id} on http://{{}}/v1 (max batch {args.max_batch}, queue {args.max_queue}{threads})")


def server_app(args):
    """(the server's ASGI app, its ServedModel): the model the flags name, its batcher, the routes; one server's,
    a --dp-size replica's and a --ray replica's."""
    served = served_model(args)
    batcher = Batcher(served.engine, max_batch=args.max_batch, max_loras=args.max_loras_per_forward,
                      lora_budget_bytes=args.lora_cache_mb << 20)
    settings = ServeSettings(api_key=args.api_key, max_batch=args.max_batch, max_queue=args.max_queue,
                             request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
                             body_timeout=args.body_timeout, lora_dir=args.lora_dir, loras=args.loras)
    return create_app(served, batcher, settings), served


def _run(app, args, sock, what: str) -> None:
    """uvicorn on ``sock`` with the connection bounds; ``what``: the start line, {} the address."""
    # uvicorn's limit_concurrency counts the connection asking too: N + 1 serves N connections (ours refuses the
    # next one) and bounds the running requests (a request whose client left still runs until it sees it)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_grace,
                            lifespan="on", http=bounded_h11(args.header_timeout, args.max_connections),
                            timeout_keep_alive=args.keep_alive_timeout, limit_concurrency=args.max_connections + 1)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT itself (graceful shutdown, then the lifespan's end closes the batcher) and
    # re-raises the signal to the handler found before it: for SIGTERM that is this one, so the exit is 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    host, port = sock.getsockname()[:2]
    print(f"sgld serve: {what.format(f'{host}:{port}')}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])


DP_ONLY = ("--dp-size", "--host", "--port", "--ray", "--ray-autoscale")  # the front's own flags, not its replicas'


def replica_argv(argv, args, cpu_threads: int = 0) -> list:
    """A replica's `sgld serve` flags: the command's own without the front's (``DP_ONLY``); on the CPU, without
    --threads, ``cpu_threads`` or the cores shared out between the replicas."""
    out, rest = [], list(argv[argv.index("serve") + 1:])
    while rest:
        flag = rest.pop(0)
        name = flag.split("=", 1)[0]
        if name in DP_ONLY:
            if "=" not in flag and rest and not rest[0].startswith("--"):  # its value (--ray's is optional)
                rest.pop(0)
            continue
        out.append(flag)
    if not args.threads and (not device_rt.available() or engine_config(args).device == "cpu"):
        out += ["--threads", str(cpu_threads or max(1, (os.cpu_count() or 1) // args.dp_size))]
    return out


def replica_envs(args) -> list:
    """Each replica's environment: on GPUs its own ``--num-gpus`` (its ranks' world) devices."""
    if not device_rt.available():
        return [{} for _ in range(args.dp_size)]
    world = engine_config(args).world_size
    have = device_rt.device_count()
    if have < args.dp_size * world:
        raise ValueError(f"--dp-size {args.dp_size} with {world} GPU(s) each needs {args.dp_size * world} GPUs; this "
                         f"machine has {have}")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(str(i * world + k) for k in range(world))} for i in range(args.dp_size)]


def _serve_replicas(args, sock) -> None:
    """`--dp-size N`: N replica processes behind this process's front (engine/serve/replicas.py)."""
    check_serve_args(args)  # once here, before N processes read the flags
    replicas = Replicas(replica_argv(args._argv, args), args.dp_size, replica_envs(args), args.request_timeout,
                        args.max_connections)
    try:
        replicas.start()
        app = create_front_app(LocalReplicas(replicas), args.api_key, args.max_body_bytes, args.body_timeout)
        _run(app, args, sock, f"{args.dp_size} replicas on http://{{}}/v1 (logs in {replicas.folder})")
    finally:
        replicas.close()


def app_from_flags(flags) -> object:
    """A --ray replica's server app from its `sgld serve` flags (parsed and checked as the command's)."""
    args = _parsed(["serve", *flags])
    if args.threads:
        torch.set_num_threads(args.threads)
    return server_app(args)[0]


def _serve_on_ray(args) -> None:
    """`--ray`: the server as a Ray Serve application (engine/serve/ray_app.py). This process deploys it, says where
    it listens and waits; SIGTERM or Ctrl-C deletes it (Serve drains each replica for --shutdown-grace s), exit 0."""
    given = [f for f in RAY_REFUSED if any(a.split("=", 1)[0] == f for a in args._argv)]
    if given:
        raise ValueError(f"{given[0]} bounds this process's HTTP server; under --ray the connections are Ray's HTTP "
                         "proxy's (set them in Ray Serve's http_options)")
    scale = ray_autoscale(args)
    check_serve_args(args)
    ray, serve, ray_app = ray_parts()
    _listen(args.host, args.port).close()  # a port in use: one line before Ray starts
    local = args.ray == "local"
    reachable(args.ray)
    try:
        ray.init(address=None if local else args.ray, include_dashboard=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"--ray {args.ray}: no Ray cluster to join there ({last_line(e)})") from None
    stop = threading.Event()

    def stopping(signum, frame):  # after ray.init, whose own handler would abort the process
        if stop.is_set():
            return
        stop.set()
        if not started:
            raise Stopped(signum)
    started = False
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopping)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        serve.run(_ray_application(args), name=ray_app.APP_NAME, route_prefix="/")
        started = True
        count = f"{scale[0]} to {scale[1]}" if scale else str(args.dp_size)
        print(f"sgld serve: {count} replicas on Ray ({'this machine' if local else args.ray}) on "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        stop.wait()
    except Stopped:
        pass  # stopped while it started: taken down below, exit 0 as after the start
    except RuntimeError as e:  # a replica that could not start (its node's files, devices): Serve's reason, one line
        raise ValueError(f"--ray: the application did not start: {last_line(e)}") from None
    finally:
        ray_app.remove(ray_app.APP_NAME)
        ray.shutdown()


def _ray_application(args):
    """The Serve application of these (checked) flags, Ray connected: each replica's flags and resources (its
    --num-gpus GPUs with --device cuda, else --threads CPUs, 1 by default), the front's guard."""
    ray, _, ray_app = ray_parts()
    config = engine_config(args)
    gpus = config.world_size if config.device.startswith("cuda") else 0  # Ray sets each its CUDA_VISIBLE_DEVICES
    if gpus and not ray.cluster_resources().get("GPU"):
        raise ValueError(f"--device {config.device}: the Ray cluster has no GPU (--device cpu runs on its CPUs)")
    threads = 0 if gpus else (args.threads or 1)
    engine_options = {"ray_actor_options": {"num_cpus": threads, "num_gpus": gpus},
                      "max_ongoing_requests": args.max_batch, "graceful_shutdown_timeout_s": args.shutdown_grace}
    front = {"api_key": args.api_key, "max_body_bytes": args.max_body_bytes, "body_timeout": args.body_timeout}
    flags = replica_argv(args._argv, args, cpu_threads=threads)
    return ray_app.application(functools.partial(app_from_flags, flags), args.dp_size, engine_options, front,
                               args.request_timeout + 30.0, ray_autoscale(args), os.getcwd())


def ray_application(options: dict):
    """`serve run engine.cli.serve:ray_application flags='--model ...' replicas=2` (and KubeRay's RayService,
    docs/serve.md): the application `sgld serve --ray` deploys, its flags checked the same way."""
    argv = ["serve", *shlex.split(str(options.get("flags", ""))), "--ray",
            "--dp-size", str(options.get("replicas", 1))]
    args = _parsed(argv, devices_here=False)
    ray_autoscale(args)
    check_serve_args(args)
    return _ray_application(args)


def _parsed(argv, devices_here: bool = True):
    """`sgld serve` flags parsed and checked as the command line's (engine/cli/__init__.py's main); the devices
    where the replica runs (``devices_here``)."""
    parser = argparse.ArgumentParser(prog="sgld")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    args._argv = list(argv)
    check_common_args(args, devices_here)
    args.loras = lora_specs(args)
    return args
