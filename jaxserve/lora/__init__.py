"""Multi-LoRA serving: PEFT adapters over one base model, many in one batch (issue 41).

`peft_adapter` reads and validates a PEFT folder; `layers` holds the device slot stacks and
the batched gather-matmul (BGMV) every targeted projection adds; `request` is vLLM's
`LoRARequest`; `host_cache` keeps loaded adapters in host memory. Which adapter sits in which
device slot is the scheduler's business (scheduler/lora_slots.py), pure Python.
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
