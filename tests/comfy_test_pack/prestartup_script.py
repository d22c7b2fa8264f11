"""Test-only: make this ComfyUI 0.3.75 look like an older one (0.3.64) that lacks features the pack probes for,
when the environment asks (SGLD_TEST_REMOVE=flux2_latent_format,flux2_vae). ComfyUI runs this before it loads
any custom node. 0.3.64 itself cannot be installed here (no network), so tests/test_comfyui_compat_old.py
simulates it this way. Without the variable nothing happens."""
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
