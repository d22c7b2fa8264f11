"""ComfyUI nodes of the SGLDiffusion pack: thin adapters between ComfyUI types and ``engine``.

Imported only inside ComfyUI (the pack's ``__init__.py`` checks), as a subpackage of the pack,
so the engine is imported relatively (``from ..engine import ...``).
"""
import glob
import json
import logging
import os

from . import cache_dit, compat, demo, latent, server_nodes
from .comfy_model import SGLDiffusionApplyCacheDiT
from .ksampler import SGLDiffusionKSampler
from .loader import SGLDiffusionModelLoader
from .lora import SGLDiffusionLoraLoader
from .model_cache import install_memory_hooks, loaded
from .run_events import last_runs

NODE_CLASS_MAPPINGS = {
    "SGLDiffusionModelLoader": SGLDiffusionModelLoader,
    "SGLDiffusionKSampler": SGLDiffusionKSampler,
    "SGLDiffusionLoraLoader": SGLDiffusionLoraLoader,
    "SGLDiffusionApplyCacheDiT": SGLDiffusionApplyCacheDiT,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "SGLDiffusionModelLoader": "SGLDiffusion Model Loader",
    "SGLDiffusionKSampler": "SGLDiffusion KSampler",
    "SGLDiffusionLoraLoader": "SGLDiffusion LoRA Loader",
    "SGLDiffusionApplyCacheDiT": "SGLDiffusion Apply Cache-DiT",
}
for module in (cache_dit, demo, latent, server_nodes):
    NODE_CLASS_MAPPINGS.update(module.NODE_CLASS_MAPPINGS)
    NODE_DISPLAY_NAME_MAPPINGS.update(module.NODE_DISPLAY_NAME_MAPPINGS)
# what this ComfyUI has of what ERNIE-Image needs; what it lacks ("" when nothing) goes on every node but the demo's and
# the remote server's (no ERNIE-Image file here)
COMPAT_FOUND = compat.check_at_startup([c for k, c in NODE_CLASS_MAPPINGS.items()
                                        if k not in demo.NODE_CLASS_MAPPINGS and k not in server_nodes.NODE_CLASS_MAPPINGS])
COMPAT_NOTICE = compat.notice(COMPAT_FOUND, compat.version())

install_memory_hooks()


PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # its name is the templates' module in ComfyUI
WORKFLOWS = os.path.join(PACK_DIR, "workflows")


def template_descriptions(folder: str = WORKFLOWS) -> dict:
    """{template name: its card's description} from each workflow's ``extra.sgldiffusion.description``: ComfyUI
    lists a pack's workflows by file name alone, and its frontend shows that name as both title and description."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                text = json.load(f)["extra"]["sgldiffusion"]["description"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(text, str) and text.strip():
            out[os.path.splitext(os.path.basename(path))[0]] = text.strip()
    return out


def _add_routes() -> None:
    """GET /sgldiffusion/models: the engines held in memory now (for the web extension and tests).
    GET /sgldiffusion/last_runs?workflow=<id>: {"runs": {node id: the last run of that KSampler}} for
    the web panel, which has nothing to show on a reloaded page or when ComfyUI reuses a cached output,
    and "compat": what this ComfyUI lacks for the ERNIE-Image workflows ("" when nothing), for the panel too.
    POST /sgldiffusion/last_runs {"workflow": id, "prompt": the API prompt of the graph shown}: the same, only
    the runs of that graph's content (another graph under the same id shows nothing of them), and "compat" only
    for what that graph needs (compat.graph_notice: "" for the demo's graph).
    GET /sgldiffusion/templates: {"templates": {workflow name: its template card's description}, "module": the name
    ComfyUI lists them under (this pack's folder), "pack": the pack's name (its nodes' category), which the web
    extension gives them as a tag so the template browser's search finds them by it}."""
    try:
        from aiohttp import web
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is None:
        return
    try:
        @server.routes.get("/sgldiffusion/models")
        async def sgld_models(request):
            return web.json_response({"loaded": loaded()})

        @server.routes.get("/sgldiffusion/templates")
        async def sgld_templates(request):
            return web.json_response({"templates": template_descriptions(), "module": os.path.basename(PACK_DIR),
                                      "pack": SGLDiffusionKSampler.CATEGORY})

        @server.routes.get("/sgldiffusion/last_runs")
        async def sgld_last_runs(request):
            workflow = request.query.get("workflow", "")
            return web.json_response({"workflow": workflow, "runs": last_runs(workflow), "compat": COMPAT_NOTICE})

        @server.routes.post("/sgldiffusion/last_runs")
        async def sgld_last_runs_of_graph(request):
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict) or not isinstance(body.get("prompt"), dict):
                return web.json_response({"error": "the body must be {\"workflow\": id, \"prompt\": the graph's "
                                                   "API prompt}"}, status=400)
            workflow = str(body.get("workflow") or "")
            return web.json_response({"workflow": workflow, "runs": last_runs(workflow, body["prompt"]),
                                      "compat": compat.graph_notice(COMPAT_FOUND, body["prompt"], compat.version())})
    except Exception:  # e.g. the router is already frozen: the nodes still work
        logging.getLogger("sgldiffusion").warning("SGLDiffusion: could not add the /sgldiffusion routes", exc_info=True)


_add_routes()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
