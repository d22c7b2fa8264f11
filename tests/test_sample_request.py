"""One request object and one image-parts protocol (issue 34 items 2 and 3): every declared sampling option is a
field of ``SampleRequest``, crosses the /v1/sample wire (engine/sample_wire.py, the one module the route and the
remote node use) and reaches a batcher ``Job``, a node's widgets and the pipeline without a line of its own there;
a served generation checks its size once (its image parts' ``latent_shape``) and keeps the latent's batch axis from
the empty latent to the decoder. In process, on the demo model."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save

from engine import EngineConfig, InputError, SampleRequest, SamplingOptions, open_engine, sample_wire
from engine.image_parts import BundledParts
from engine.models.demo import load_demo
from engine.options import declared
from engine.pipeline import OTHER_OPTIONS
from engine.serve import Batcher, ImageServer, Job, ServedModel, ServeSettings
from engine.serve.protocol import ImageRequest, parse_generation

# a value other than the default for each kind of option (the wire and the objects carry values, they do not check)
OTHER = {int: 7, float: 0.5, str: "heun"}


def test_every_sampling_option_is_a_request_field_and_crosses_the_wire():
    given = {name: OTHER[opt.kind] for name, opt in declared(SamplingOptions).items()}
    request = SampleRequest(latent=torch.zeros(1, 48, 16, 16), cond=torch.ones(3, 128), uncond=torch.zeros(2, 128), **given,
                            batch_index=[2], sigmas=torch.tensor([0.5, 0.0]), noise_mask=torch.ones(1, 8, 8))
    assert dataclasses.asdict(request.options) == given
    back = sample_wire.decode(sample_wire.encode(request))
    assert dataclasses.asdict(back.options) == given and back.batch_index == [2]
    assert torch.equal(back.cond, request.cond) and torch.equal(back.sigmas, request.sigmas)
    job = Job.of(back)
    assert dataclasses.asdict(job.options) == given and job.on_step is None
    for name, opt in declared(SamplingOptions).items():  # the other entry points derive theirs from the declaration
        assert name in sample_wire.settings_fields()
        if opt.api:
            assert opt.api in ImageRequest.model_fields
        if opt.widget:
            assert getattr(SamplingOptions.of_widgets({opt.widget: given[name]}), name) == given[name]
        assert name in OTHER_OPTIONS or name in ("seed", "steps", "cfg", "sampler", "scheduler", "shift")


def test_a_requests_loras_cross_the_wire_and_a_local_engine_refuses_them(eng):
    """Per-request LoRAs by name (issue 37): the remote KSampler's chain reaches the route's Job; a local engine takes
    its LoRAs from Engine.set_loras, so Engine.sample refuses names (never drops them)."""
    request = SampleRequest(latent=torch.zeros(48, 16, 16), cond=torch.ones(3, 128), seed=1, steps=2, cfg=1.0,
                            loras=(("style.safetensors", 0.8), ("sub/detail.safetensors", -1.0)))
    assert Job.of(sample_wire.decode(sample_wire.encode(request))).loras == request.loras
    with pytest.raises(InputError, match="loras: .*Engine.set_loras"):
        eng.sample(torch.zeros(1, 48, 16, 16), [torch.ones(3, 128)], None, seed=1, steps=2, cfg=1.0,
                   loras=(("style.safetensors", 1.0),))


@pytest.mark.parametrize("settings, param, code", [
    ({"seed": 0, "steps": 2, "cfg": 1.0, "guidance": 2}, "guidance", "unknown_field"),
    ({"steps": 2, "cfg": 1.0}, "seed", "invalid_value"),
    ({"seed": 0, "steps": "2", "cfg": 1.0}, "steps", "invalid_value"),
    ({"seed": 0, "steps": 2.0, "cfg": 1.0}, "steps", "invalid_value"),
    ({"seed": 0, "steps": 2, "cfg": True}, "cfg", "invalid_value"),
    ({"seed": 0, "steps": 2, "cfg": 1.0, "batch_index": [True]}, "batch_index", "invalid_value"),
    ({"seed": 0, "steps": 2, "cfg": 1.0, "cache": "nope"}, "cache", "invalid_value"),
    ({"seed": 0, "steps": 2, "cfg": 1.0, "loras": [{"name": "a", "strength": "1"}]}, "loras[0].strength", "invalid_value"),
    ({"seed": 0, "steps": 2, "cfg": 1.0, "loras": {"name": "a"}}, "loras", "invalid_value"),
])
def test_the_wire_refuses_settings_by_name(settings, param, code):
    body = save({"latent": torch.zeros(48, 16, 16), "cond": torch.zeros(4, 128)},
                metadata={sample_wire.METADATA_KEY: json.dumps(settings)})
    with pytest.raises(sample_wire.WireError) as e:
        sample_wire.decode(body)
    assert (e.value.param, e.value.code) == (param, code) and param in str(e.value)


class CountingParts(BundledParts):
    """The demo's parts, counting the size checks and recording the latents decoded."""

    def __init__(self, demo):
        super().__init__(demo)
        self.sizes_checked, self.decoded = 0, []

    def latent_shape(self, width, height, batch=1):
        self.sizes_checked += 1
        return super().latent_shape(width, height, batch)

    def decode(self, latent):
        self.decoded.append(tuple(latent.shape))
        return super().decode(latent)


def test_a_served_generation_checks_its_size_once_and_keeps_the_batch_axis():
    eng = open_engine("demo", EngineConfig(dtype="fp32"))
    parts = CountingParts(load_demo())
    batcher = Batcher(eng, max_batch=4)
    try:
        served = ServedModel("sgld-demo", eng, parts, 30, 3.0)
        gen = parse_generation({"prompt": "a red circle", "n": 2, "size": "64x64", "num_inference_steps": 1}, served)
        out = asyncio.run(ImageServer(served, batcher, ServeSettings()).generate(gen))
    finally:
        batcher.close()
    assert len(out["data"]) == 2 and out["num_inference_steps"] == 1
    assert parts.sizes_checked == 1  # once, when the request was read
    assert parts.decoded == [(1, 48, 16, 16)] * 2  # each image's latent as the batcher answered it
