"""``sgld serve``: an OpenAI-compatible image server over step-level continuous batching.

batcher.py + forward.py: ``Batcher`` / ``Job``, one DiT forward per step over every running request;
server.py: ``ImageServer`` (settings, batcher, LoRA state, admission, the work); app.py: its routers and the app; sample_route.py: POST /v1/sample;
protocol.py: request checks and OpenAI error bodies; guard.py: API key and body size and time; connections.py: the headers' time and the connection cap (uvicorn's protocol); loras.py: the
LoRA endpoints; metrics.py: Prometheus. engine/cli/serve.py starts it under uvicorn.
"""
from .app import create_app
from .batcher import Batcher, Job
from .server import ImageServer, ServedModel, ServeSettings

__all__ = ["Batcher", "ImageServer", "Job", "ServedModel", "ServeSettings", "create_app"]
