"""What only developers run, kept out of the shipped package (the wheel and the Comfy Registry pack):
``tools.demo`` (training the demo model, its scene generator and judge) and ``tools.cache_docs`` (writes
docs/cache_dit.md). Run from the repository root: ``python -m tools.demo.train``, ``python -m tools.cache_docs``."""
