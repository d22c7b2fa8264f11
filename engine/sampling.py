"""Flow-matching sampling exactly as ComfyUI does it for flow DiTs such as ERNIE-Image (ModelSamplingDiscreteFlow,
CONST parameterisation, multiplier 1000): sigma schedules, samplers, CFG and seeded noise.

Samplers work on a *denoiser* ``denoised = D(x, sigma)`` like k-diffusion, so the arithmetic is
the same as ComfyUI's to the last bit for the same model outputs (tests compare against
ComfyUI's own functions).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

SCHEDULERS = ("simple", "normal", "beta")
SAMPLERS = ("euler", "euler_ancestral", "heun", "dpmpp_2m")
DEFAULT_SHIFT = 3.0  # ComfyUI's ERNIE-Image shift (diffusers uses 4.0)
MULTIPLIER = 1000.0  # sigma -> model timestep

# Input limits, in one place (Engine.sample, the CLI and the nodes check against these before any work).
# Generous: ComfyUI's KSampler allows 1..10000 steps, cfg 0..100, seeds 0..2**64-1 and shift 0..100;
# ERNIE-Image's largest documented size is 2048x2048. A family's image-token limit follows from MAX_IMAGE_SIDE
# and its latent's stride (engine.inputs.max_image_tokens).
MAX_STEPS = 10000
MAX_SCHEDULE = 10000  # steps / denoise: the full schedule a denoise < 1 run takes its last steps from
MAX_CFG = 100.0
MAX_SHIFT = 100.0
MAX_SEED = 2 ** 64 - 1  # torch.Generator.manual_seed's largest value
MAX_IMAGE_SIDE = 4096  # pixels, any family (ERNIE-Image files: twice the largest documented size)
MAX_TEXT_TOKENS = 2048  # a prompt's tokens: the text encoder reads at most this many (models/external.py)
MAX_BATCH = 4096  # latents in an empty batch (ComfyUI's empty-latent nodes allow 1..4096)
MAX_INPUT_VALUE = 1e6  # |value| of a latent or text feature: beyond it the DiT's sums overflow (NaN, not a picture)
MAX_BATCH_INDEX = 4095  # a LATENT's batch_index: noise is drawn for every index up to the largest (ImageFromBatch's limit)

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
StepCallback = Callable[[int, torch.Tensor, torch.Tensor], None]  # (step index, x, denoised)


def to_timestep(sigma):
    """The model's timestep for a sigma (ComfyUI's CONST flow: sigma x MULTIPLIER); every caller of the DiT uses it."""
    return sigma * MULTIPLIER


def to_sigma(timestep):
    """The sigma of a model timestep (``to_timestep``'s inverse)."""
    return timestep / MULTIPLIER


def cfg_on(cfg, uncond=None) -> bool:
    """Whether a run computes a negative branch: a negative given (not None) and cfg not 1 (at 1 the guided
    result is the positive one). One rule for the engine, the server's batcher and the nodes."""
    return uncond is not None and cfg != 1.0


def time_snr_shift(shift: float, t):
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


class FlowSigmas:
    """ComfyUI's ModelSamplingDiscreteFlow table: 1000 shifted sigmas, ascending."""

    def __init__(self, shift: float = DEFAULT_SHIFT, timesteps: int = 1000):
        self.shift = shift
        self.table = self.sigma(to_timestep(torch.arange(1, timesteps + 1, 1) / timesteps))

    def sigma(self, timestep):
        return time_snr_shift(self.shift, to_sigma(timestep))

    def timestep(self, sigma):
        return to_timestep(sigma)

    @property
    def sigma_min(self):
        return self.table[0]

    @property
    def sigma_max(self):
        return self.table[-1]


def _simple(fs: FlowSigmas, steps: int) -> torch.Tensor:
    stride = len(fs.table) / steps
    return torch.FloatTensor([float(fs.table[-(1 + int(x * stride))]) for x in range(steps)] + [0.0])


def _normal(fs: FlowSigmas, steps: int) -> torch.Tensor:
    start, end = fs.timestep(fs.sigma_max), fs.timestep(fs.sigma_min)
    append_zero = True
    if math.isclose(float(fs.sigma(end)), 0, abs_tol=0.00001):
        steps += 1
        append_zero = False
    sigs = [float(fs.sigma(ts)) for ts in torch.linspace(start, end, steps)]
    return torch.FloatTensor(sigs + ([0.0] if append_zero else []))


def _beta(fs: FlowSigmas, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    from scipy.stats import beta as beta_dist

    total = len(fs.table) - 1
    ts = np.rint(beta_dist.ppf(1 - np.linspace(0, 1, steps, endpoint=False), alpha, beta) * total)
    sigs, last = [], -1
    for t in ts:
        if t != last:
            sigs.append(float(fs.table[int(t)]))
        last = t
    return torch.FloatTensor(sigs + [0.0])


def sigma_schedule(steps: int, scheduler: str = "simple", denoise: float = 1.0, shift: float = DEFAULT_SHIFT) -> torch.Tensor:
    """Sigmas for a run, ending in 0; with denoise < 1 only the last ``steps`` of a longer schedule."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler '{scheduler}' is not supported; choose one of {', '.join(SCHEDULERS)}")
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be from 1 to {MAX_STEPS} (got {steps})")
    if denoise is not None and not math.isfinite(denoise):
        raise ValueError(f"denoise must be a finite number from 0 to 1 (got {denoise})")
    make = {"simple": _simple, "normal": _normal, "beta": _beta}[scheduler]
    fs = FlowSigmas(shift)
    if denoise is None or denoise > 0.9999:
        return make(fs, steps)
    if denoise <= 0.0:
        return torch.FloatTensor([])
    if steps / denoise > MAX_SCHEDULE:  # the full schedule is built: bound it before it is
        raise ValueError(f"steps / denoise must be at most {MAX_SCHEDULE} (got {steps} / {denoise})")
    return make(fs, int(steps / denoise))[-(steps + 1):]


def seeded_noise(shape, seed: int, batch_index: Optional[Sequence[int]] = None) -> torch.Tensor:
    """ComfyUI's noise (comfy.sample.prepare_noise): torch.manual_seed(seed), then randn of the latent's shape,
    CPU float32. With ``batch_index`` (the LATENT's, set by LatentFromBatch), one sample's noise is drawn
    after another for the indices 0 .. max, and sample i gets draw ``batch_index[i]``: a sample cut out of a
    batch keeps the noise it had in the batch."""
    gen = torch.Generator().manual_seed(int(seed))
    if batch_index is None:
        return torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu")
    wanted, draws = set(batch_index), {}
    for i in range(max(batch_index) + 1):
        draw = torch.randn((1, *shape[1:]), generator=gen, dtype=torch.float32, device="cpu")
        if i in wanted:
            draws[i] = draw
    return torch.cat([draws[i] for i in batch_index])


def noise_scaling(sigma: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    return sigma * noise + (1.0 - sigma) * latent


def prepare_mask(mask: torch.Tensor, shape) -> torch.Tensor:
    """A denoise mask [N, 1, h, w] (or [h, w], [N, h, w]) at any resolution -> [B, C, H, W] for a latent of
    ``shape``, as ComfyUI's comfy.utils.reshape_mask makes it: bilinear to the latent's size, repeated over
    the channels, the N masks tiled (or cut) to the batch. Masks past the batch are cut before any scaling:
    the work is the latent's size, however many masks come."""
    batch = shape[0]
    m = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1])[:batch].to(torch.float32)
    m = F.interpolate(m, size=tuple(shape[2:]), mode="bilinear")
    return m.repeat(math.ceil(batch / m.shape[0]), shape[1], 1, 1)[:batch]


def inpaint_denoiser(denoiser: Denoiser, mask: torch.Tensor, noise: torch.Tensor, latent: torch.Tensor) -> Denoiser:
    """ComfyUI's KSamplerX0Inpaint around ``denoiser``, at every model call: where ``mask`` is 0 (keep) the
    model sees the input ``latent`` noised to the call's sigma with the run's own ``noise``, and the sampler
    gets the input latent back as the denoised; where it is 1 both are the sampler's own."""
    def masked(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - mask
        x = x * mask + noise_scaling(sigma.reshape(-1, 1, 1, 1), noise, latent) * keep
        return denoiser(x, sigma) * mask + latent * keep

    return masked


# -- samplers (ComfyUI / k-diffusion definitions, flow models) -----------------------------------

def sample_euler(denoiser: Denoiser, x, sigmas, callback=None, seed=None):
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        d = (x - denoised) / sigmas[i]
        if callback is not None:
            callback(i, x, denoised)
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


def sample_euler_ancestral(denoiser: Denoiser, x, sigmas, callback=None, seed=None, eta: float = 1.0, s_noise: float = 1.0):
    """ComfyUI's ``sample_euler_ancestral_RF`` (what euler_ancestral means for flow models)."""
    gen = torch.Generator(device=x.device)
    if seed is not None:
        gen.manual_seed(int(seed))
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        if callback is not None:
            callback(i, x, denoised)
        if sigmas[i + 1] == 0:
            x = denoised
            continue
        downstep_ratio = 1 + (sigmas[i + 1] / sigmas[i] - 1) * eta
        sigma_down = sigmas[i + 1] * downstep_ratio
        alpha_ip1 = 1 - sigmas[i + 1]
        alpha_down = 1 - sigma_down
        renoise_coeff = (sigmas[i + 1] ** 2 - sigma_down ** 2 * alpha_ip1 ** 2 / alpha_down ** 2) ** 0.5
        ratio = sigma_down / sigmas[i]
        x = ratio * x + (1 - ratio) * denoised
        if eta > 0:
            noise = torch.randn(x.size(), dtype=x.dtype, layout=x.layout, device=x.device, generator=gen)
            x = (alpha_ip1 / alpha_down) * x + noise * s_noise * renoise_coeff
    return x


def sample_heun(denoiser: Denoiser, x, sigmas, callback=None, seed=None):
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        d = (x - denoised) / sigmas[i]
        if callback is not None:
            callback(i, x, denoised)
        dt = sigmas[i + 1] - sigmas[i]
        if sigmas[i + 1] == 0:
            x = x + d * dt
        else:
            x_2 = x + d * dt
            denoised_2 = denoiser(x_2, sigmas[i + 1] * s_in)
            d_2 = (x_2 - denoised_2) / sigmas[i + 1]
            x = x + (d + d_2) / 2 * dt
    return x


def sample_dpmpp_2m(denoiser: Denoiser, x, sigmas, callback=None, seed=None):
    s_in = x.new_ones([x.shape[0]])

    def t_fn(sigma):
        return sigma.log().neg()

    old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = denoiser(x, sigmas[i] * s_in)
        if callback is not None:
            callback(i, x, denoised)
        t, t_next = t_fn(sigmas[i]), t_fn(sigmas[i + 1])
        h = t_next - t
        if old_denoised is None or sigmas[i + 1] == 0:
            x = (t_next.neg().exp() / t.neg().exp()) * x - (-h).expm1() * denoised
        else:
            r = (t - t_fn(sigmas[i - 1])) / h
            denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised
            x = (t_next.neg().exp() / t.neg().exp()) * x - (-h).expm1() * denoised_d
        old_denoised = denoised
    return x


SAMPLER_FUNCTIONS = {
    "euler": sample_euler,
    "euler_ancestral": sample_euler_ancestral,
    "heun": sample_heun,
    "dpmpp_2m": sample_dpmpp_2m,
}


def model_calls(sampler: str, steps: int) -> int:
    """Forward passes per branch a sampler makes for ``steps`` steps (heun: two, except the last)."""
    return 2 * steps - 1 if sampler == "heun" else steps


def step_of_call(sampler: str, call: int) -> int:
    """The step (0-based) that a sampler's model call (0-based) belongs to (heun: two calls a step)."""
    return call // 2 if sampler == "heun" else call


def run_sampler(name: str, denoiser: Denoiser, x: torch.Tensor, sigmas: torch.Tensor,
                callback: Optional[StepCallback] = None, seed: Optional[int] = None) -> torch.Tensor:
    if name not in SAMPLER_FUNCTIONS:
        raise ValueError(f"sampler '{name}' is not supported; choose one of {', '.join(SAMPLERS)}")
    return SAMPLER_FUNCTIONS[name](denoiser, x, sigmas, callback=callback, seed=seed)
