"""Adapters on the host: every adapter a request named, and the most recently used ones
read into host memory (vLLM's --max-cpu-loras); one evicted from memory is read again from
its folder when a device slot needs it."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from jaxserve.lora.peft_adapter import LoRAAdapter, load_peft_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.model.config import ModelConfig


class LoRAHostCache:
    def __init__(self, base: ModelConfig, max_lora_rank: int, max_cpu_loras: int, dtype):
        self.base, self.max_lora_rank, self.max_cpu_loras, self.dtype = base, max_lora_rank, max_cpu_loras, dtype
        self.requests: dict[int, LoRARequest] = {}  # every adapter named so far, by id
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first

    def register(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Read and validate the request's adapter (LoRAConfigError, a ValueError, if it cannot
        be served), or take `adapter`, read already (`read`); an id seen before must name the
        same adapter."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} at {known.lora_path}"
            )
        if adapter is not None:
            self._keep(request.lora_int_id, adapter)
        adapter = self._get(request)
        self.requests[request.lora_int_id] = request
        return adapter

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and validate the request's adapter without keeping it: safe from any thread,
        so a server reads a new adapter off the engine thread."""
        return load_peft_adapter(request.lora_path, self.base, self.max_lora_rank)

    def slot_arrays(self, lora_id: int) -> list[dict[str, np.ndarray]]:
        """What the device slot stacks take for this adapter (LoRAAdapter.slot_arrays)."""
        return self._get(self.requests[lora_id]).slot_arrays(self.base, self.max_lora_rank, self.dtype)

    def _get(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = self.read(request)
            self._keep(request.lora_int_id, adapter)
        self._loaded.move_to_end(request.lora_int_id)
        return adapter

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._loaded[lora_id] = adapter
        self._loaded.move_to_end(lora_id)
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)
