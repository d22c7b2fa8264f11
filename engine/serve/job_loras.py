"""A batcher's per-request LoRAs: a job's LoRAs named, checked (from their headers) and read against the model
before it is queued, and made ready for each forward (engine/features/lora/rows.py's cache: a job holds entries,
not data). A LoRA that cannot be made ready fails the jobs that named it, never the others of the forward."""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import InputError
from ..features.compile import is_compiled
from ..features.lora import LoRAError, attach_row_loras, remove_row_loras
from ..features.lora.rows import CachedLoRA, RowLoRAs


class JobLoRAs:
    def __init__(self, engine, max_loras: int, budget_bytes: int):
        """``max_loras``: distinct LoRAs in one forward; ``budget_bytes``: the cache's (files and resident terms)."""
        self.engine, self.max_loras, self.budget = engine, max_loras, budget_bytes
        self.local = engine.model is not None
        self._cache: Optional[RowLoRAs] = None
        self._lock = threading.Lock()

    @property
    def cache(self) -> Optional[RowLoRAs]:
        """The model's per-request LoRA cache, attached when first asked for; None on several ranks (they keep one
        run at a time)."""
        if not self.local:
            return None
        with self._lock:
            if self._cache is None:
                self._cache = attach_row_loras(self.engine.model, self.budget)
            return self._cache

    def check(self, lora_set) -> Optional[list]:
        """A job's [(path or LoRAFile, strength)] as the cache's entries, each named once, checked and read, and
        what its rows need within ``max_loras`` (InputError naming ``loras``)."""
        if lora_set is None:
            return None
        own = self._call("named", lora_set)
        self.net(own, read=True)
        return own

    def net(self, lora_set, read: Optional[bool] = None) -> List[Tuple[CachedLoRA, float]]:
        """What a job's rows need on top of the merged set (rows.py ``net``), checked; ``read``: the files now
        (None: unless they came as the cache's entries, which ``check`` read)."""
        if lora_set is None:
            return []
        if read is None:
            read = any(not isinstance(source, CachedLoRA) for source, _ in lora_set)
        net_set = self._call("job_set", lora_set, read)
        if len(net_set) > self.max_loras:
            raise InputError(f"loras: this job needs {len(net_set)} distinct LoRAs on its rows (its own, and the "
                             f"engine's active ones taken off), more than the {self.max_loras} one forward carries "
                             "(sgld serve --max-loras-per-forward)")
        return net_set

    def _call(self, method: str, *args):
        if not self.local:
            raise InputError("loras: per-request LoRAs need the model in this process (on several ranks set them for "
                             "every request with /v1/set_lora)")
        if is_compiled(self.engine.model):
            raise InputError("loras: per-request LoRAs do not run on a compiled model (--compile); set them for every "
                             "request with /v1/set_lora")
        try:
            return getattr(self.cache, method)(*args)
        except LoRAError as e:
            raise InputError(f"loras: {e}") from None

    def fits(self, nets: Sequence[list]) -> bool:
        """The distinct LoRAs of these jobs' nets fit one forward."""
        return len({e.ident for net in nets for e, _ in net}) <= self.max_loras

    def device_bytes(self, nets: Sequence[list]) -> int:
        """Their terms' bytes on the compute device, and those resident already (0 before any LoRA was named)."""
        return self._cache.device_bytes([e for net in nets for e, _ in net]) if self._cache is not None else 0

    def ready(self, jobs: Sequence[Tuple[list, int]]) -> Tuple[Dict[tuple, int], Dict[int, InputError]]:
        """For one forward's jobs ((net, rows) each): ({identity: adapter key}, {job index: its error}) — a job
        whose LoRA could not be read again or made resident fails, naming it; the others run."""
        if not any(net for net, _ in jobs):
            return {}, {}
        keys, failed = self.cache.use([(e, rows) for net, rows in jobs for e, _ in net])
        errors = {}
        for i, (net, _) in enumerate(jobs):
            bad = next((failed[e.ident] for e, _ in net if e.ident in failed), None)
            if bad is not None:
                errors[i] = InputError(f"loras: {bad}")
        return keys, errors

    def close(self) -> None:
        """The per-request LoRAs' terms off the model (their counters stay readable)."""
        if self._cache is not None:
            remove_row_loras(self.engine.model)
