"""Test-only: make this ComfyUI 0.3.75 look like an older one (0.3.64) that lacks features the pack probes for,
when the environment asks (SGLD_TEST_REMOVE=flux2_latent_format,flux2_vae), or like the newest one (2026) that
has a host-memory pin budget (SGLD_TEST_PIN_BUDGET=1: ``comfy.model_management.ensure_pin_budget``, recording the
sizes asked for). ComfyUI runs this before it loads any custom node. Neither 0.3.64 nor a 2026 ComfyUI can be
installed here (no network), so tests/test_comfyui_compat_old.py and tests/test_comfyui_model_memory.py simulate
them this way. Without the variables nothing happens."""
import os

REMOVE = {name for name in os.environ.get("SGLD_TEST_REMOVE", "").split(",") if name}
if REMOVE:
    import comfy.ldm.models.autoencoder as autoencoder
    import comfy.latent_formats
    import comfy.supported_models  # noqa: F401 - its classes take Flux2 at import; our pack must not find it later

    if "flux2_latent_format" in REMOVE:
        del comfy.latent_formats.Flux2
    if "flux2_vae" in REMOVE:
        original = autoencoder.AutoencodingEngineLegacy.__init__

        def __init__(self, *args, **kwargs):  # a VAE class whose source knows no batch-normed latent
            original(self, *args, **kwargs)

        autoencoder.AutoencodingEngineLegacy.__init__ = __init__

if os.environ.get("SGLD_TEST_PIN_BUDGET"):
    import comfy.model_management as mm

    mm.PIN_BUDGET_REQUESTS = []

    def ensure_pin_budget(size, evict_active=False, loaded=False):  # the newest ComfyUI's name; records only
        mm.PIN_BUDGET_REQUESTS.append(size)
        return True

    mm.ensure_pin_budget = ensure_pin_budget
