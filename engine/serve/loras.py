"""The LoRA endpoints' state: nicknames and their files (only from --lora-dir, or the --lora flags the server
started with; a nickname is never the name of a file in --lora-dir, so a file's name always means that file)
and which are active. A change is planned and checked first, then applied whole through
``Engine.set_loras`` (which applies the full list or nothing), then recorded."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from ..errors import LoRAError
from .protocol import ApiError, SetLoraRequest, UnsetLoraRequest, as_list, bad_field, lora_file

Plan = List[Tuple[str, str, float]]  # (nickname, real path, strength) that will be active
MAX_NICKNAME = 64  # characters
MAX_ACTIVE = 8  # LoRAs active at once (the engine keeps as many files read)
MAX_KNOWN = 64  # nicknames remembered with their files; the least recently set inactive ones are forgotten


class Loras:
    def __init__(self, engine, lora_dir: Optional[str], startup: List[Tuple[str, float]], cache=None):
        """``cache``: the batcher's per-request LoRA cache (``RowLoRAs``; None on several ranks): the active set is
        read through it, so a request naming an active LoRA gets the very file the weights hold."""
        self.engine, self.lora_dir, self.cache = engine, lora_dir, cache
        self.files: Dict[str, str] = {}  # nickname -> real path
        self.active: Plan = []
        for path, strength in startup:
            nickname = os.path.splitext(os.path.basename(path))[0]
            self.files[nickname] = os.path.realpath(path)
            self.active.append((nickname, self.files[nickname], strength))

    def plan_set(self, req: SetLoraRequest) -> Plan:
        """Exactly these adapters active (SGLang's set_lora: a new one replaces the old)."""
        nicknames, paths = as_list(req.lora_nickname), as_list(req.lora_path)
        strengths = as_list(req.strength)
        if not nicknames or len(set(nicknames)) != len(nicknames) or not all(map(_good_nickname, nicknames)):
            raise bad_field("lora_nickname", f"lora_nickname must be one name or a list of distinct names, each of 1 to "
                                             f"{MAX_NICKNAME} printable characters")
        if len(nicknames) > MAX_ACTIVE:
            raise bad_field("lora_nickname", f"at most {MAX_ACTIVE} LoRAs can be active at once (got {len(nicknames)})")
        if req.lora_path is None:
            paths = [None] * len(nicknames)
        if len(strengths) == 1:
            strengths = strengths * len(nicknames)
        for field, values in (("lora_path", paths), ("strength", strengths)):
            if len(values) != len(nicknames):
                raise bad_field(field, f"{field} has {len(values)} entries for {len(nicknames)} lora_nickname(s)")
        plan = []
        for nickname, path, strength in zip(nicknames, paths, strengths):
            shadowed = self._file(nickname)
            if shadowed is not None and (path is None or lora_file(self.lora_dir, path) != shadowed):
                raise bad_field("lora_nickname", f"lora_nickname '{nickname:.80}' is the name of a file in --lora-dir, "
                                                 "which requests naming it always get: choose another nickname")
            if path is None:
                if nickname not in self.files:
                    raise bad_field("lora_path", f"LoRA '{nickname:.80}' is not loaded yet: give its lora_path "
                                                 "(a file inside --lora-dir)")
                real = self.files[nickname]
            else:
                real = lora_file(self.lora_dir, path)
            plan.append((nickname, real, float(strength)))
        return plan

    def plan_unset(self, req: UnsetLoraRequest) -> Plan:
        """Without names: none active; else the active ones but those named."""
        if req.lora_nickname is None:
            return []
        names = as_list(req.lora_nickname)
        active = {n for n, _, _ in self.active}
        unknown = [n for n in names if n not in active]
        if unknown:
            raise bad_field("lora_nickname", f"LoRA '{unknown[0]:.80}' is not active (active: "
                                             f"{', '.join(sorted(active)) or 'none'})")
        return [a for a in self.active if a[0] not in names]

    def apply(self, plan: Plan) -> List[str]:
        """Blocking (run it off the event loop, with no generation running): the engine's messages about keys
        not applied. A file the model cannot take is a 400 and changes nothing."""
        try:
            read = self.cache.read if self.cache is not None else (lambda path: path)
            messages = self.engine.set_loras([(read(path), strength) for _, path, strength in plan])
        except LoRAError as e:
            raise ApiError(400, str(e), param="lora_path", code="invalid_lora") from None
        for nickname, path, _ in plan:
            self.files.pop(nickname, None)
            self.files[nickname] = path  # the most recently set last
        self.active = list(plan)
        active = {n for n, _, _ in plan}
        for nickname in [n for n in self.files if n not in active][:max(0, len(self.files) - MAX_KNOWN)]:
            del self.files[nickname]
        return messages

    def resolve(self, loras) -> Optional[list]:
        """A request's loras by name (a nickname /v1/set_lora gave, else a file inside --lora-dir) ->
        [(real path, strength)]; None: the active set. A 400 naming the entry."""
        if loras is None:
            return None
        out = []
        for i, (name, strength) in enumerate(loras):
            real = self._file(name) or self.files.get(name)  # a file's name always means that file
            if real is None:
                try:
                    real = lora_file(self.lora_dir, name)
                except ApiError as e:
                    raise bad_field(f"loras[{i}].name", f"loras[{i}].name '{name:.200}': {e.message} (a file inside "
                                                        "--lora-dir, or a nickname /v1/set_lora gave)") from None
            out.append((real, strength))
        return out

    def _file(self, name: str) -> Optional[str]:
        """The real path of the file ``name`` names inside --lora-dir, or None (no such file)."""
        try:
            return lora_file(self.lora_dir, name) if self.lora_dir else None
        except ApiError:
            return None

    def listing(self) -> dict:
        """SGLang's list_loras answer; paths as given inside --lora-dir."""
        def shown(path):
            root = os.path.realpath(self.lora_dir) if self.lora_dir else None
            return os.path.relpath(path, root) if root and path.startswith(root + os.sep) else path
        return {"loaded_adapters": [{"nickname": n, "path": shown(p)} for n, p in self.files.items()],
                "active": {"transformer": [{"nickname": n, "path": shown(p), "merged": True, "strength": s}
                                           for n, p, s in self.active]}}


def _good_nickname(name: str) -> bool:
    return 0 < len(name) <= MAX_NICKNAME and name.isprintable()
