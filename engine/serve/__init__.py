"""Serving: step-level continuous batching over one engine (``Batcher``, ``Job``); the HTTP server builds on it."""
from .batcher import Batcher, Job

__all__ = ["Batcher", "Job"]
