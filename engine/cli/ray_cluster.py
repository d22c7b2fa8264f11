"""Ray as `sgld serve --ray` reaches it (engine/cli/serve.py deploys, engine/serve/ray_app.py is the application):
the optional import, the cluster's address checked before Ray retries it for minutes, Ray's errors in one line, the
flags Ray's proxy holds instead of this process."""
from __future__ import annotations

import socket
import types

RAY_REFUSED = ("--header-timeout", "--keep-alive-timeout", "--max-connections")  # uvicorn's: Ray's proxy holds them


def ray_autoscale(args):
    """--ray-autoscale MIN:MAX as (min, max), or None."""
    if args.ray_autoscale is None:
        return None
    if args.ray is None:
        raise ValueError("--ray-autoscale scales a --ray deployment: add --ray")
    low, _, high = args.ray_autoscale.partition(":")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise ValueError(f"--ray-autoscale must be MIN:MAX with 1 <= MIN <= MAX (got {args.ray_autoscale!r})")
    return int(low), int(high)


def reachable(address: str) -> None:
    """A cluster's address (HOST:PORT, ray://HOST:PORT) answers a connection within 5 s, or one line (Ray itself
    retries an unreachable address for minutes)."""
    if address in ("local", "auto"):
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--ray {address}: give the cluster's HOST:PORT (`ray start --head` prints it) or "
                         "ray://HOST:PORT")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"--ray {address}: no Ray cluster answers there ({e.strerror or e})") from None


def last_line(error: Exception) -> str:
    """The last line of a Ray error (its cause; the lines before are a remote traceback)."""
    return ([ln.strip() for ln in str(error).splitlines() if ln.strip()] or [type(error).__name__])[-1][:500]


class Stopped(BaseException):
    """SIGTERM / Ctrl-C while the Ray application starts: unwinds to its removal."""


def ray_parts():
    """(ray, ray.serve, engine/serve/ray_app.py's application and remove): the [cluster] extra, or a one-line error
    saying how to install it."""
    try:
        import ray
        from ray import serve

        from ..serve.ray_app import APP_NAME, application, remove
    except ImportError as e:
        if (e.name or "").split(".")[0] != "ray":
            raise
        raise ValueError("--ray needs Ray Serve ('ray' is not installed): pip install 'comfyui-sgldiffusion[cluster]' "
                         "(from the pack's folder: pip install -e '.[cluster]')") from None
    return ray, serve, types.SimpleNamespace(APP_NAME=APP_NAME, application=application, remove=remove)
