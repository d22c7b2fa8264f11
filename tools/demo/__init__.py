"""The demo model's training side: ``data`` (procedural scenes and their captions), ``judge`` (does a picture
match its caption?) and ``train`` (the run that made engine/models/demo/weights). Sampling needs none of it."""
