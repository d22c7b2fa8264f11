"""``sgld serve``: an OpenAI-compatible image server (app.py: FastAPI app; protocol.py: request checks and
OpenAI error bodies; guard.py: API key and body size; loras.py: the LoRA endpoints; metrics.py: Prometheus;
sequential.py: the one-job-at-a-time batcher). engine/cli/serve.py starts it under uvicorn."""
from .app import ServedModel, ServeSettings, create_app

__all__ = ["ServedModel", "ServeSettings", "create_app"]
