"""ComfyUI entry point of the SGLDiffusion pack. Only registers nodes; nothing heavy happens here.

ComfyUI imports this folder as a package (its ``sys.modules`` name is derived from the folder's
absolute path), so everything below is imported relatively. Outside ComfyUI (no ``folder_paths``
module) the mappings stay empty, so importing the package never fails; ``import engine`` from the
repository root does not go through this file at all.
"""
WEB_DIRECTORY = "./web"
NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

try:
    import folder_paths  # noqa: F401  (a ComfyUI module: present only inside ComfyUI)
except ImportError:
    folder_paths = None

if folder_paths is not None:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
