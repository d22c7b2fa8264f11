"""SGLDiffusion engine."""
