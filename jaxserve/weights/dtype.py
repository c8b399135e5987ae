"""`--dtype auto`: the checkpoint's own dtype on an accelerator, float32 on the CPU.

On a GPU a float32 model runs at half the memory bandwidth and never reaches the
Mosaic kernels (bf16/f16 only), so there the weights keep the dtype they were trained
and saved in. On the CPU bfloat16 and float16 matmuls are emulated and slower than
float32, so the CPU stays float32 whatever the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def choose_dtype(requested: str, checkpoint_dtype: str, backend: str) -> str:
    """The dtype to run in: `requested` unless it is "auto"; then float32 when `backend`
    (jax's default backend: "cpu", "gpu", "tpu") is the CPU, else `checkpoint_dtype`."""
    if requested != "auto":
        return requested
    return "float32" if backend == "cpu" else checkpoint_dtype


def checkpoint_dtype(source: str | Path) -> str:
    """The dtype a model was saved in: config.json's `torch_dtype` (or `dtype`, as newer
    transformers write it); a GGUF file's 16-bit float tensors (bfloat16 if it has any,
    else float16: its quantized blocks carry float16 scales)."""
    path = Path(source)
    if path.is_file():
        from gguf import GGMLQuantizationType

        from jaxserve.weights.gguf_reader import GGUFFile

        types = {t.tensor_type for t in GGUFFile(path).reader.tensors}
        return "bfloat16" if GGMLQuantizationType.BF16 in types else "float16"
    import json

    with open(path / "config.json") as f:
        config = json.load(f)
    return config_dtype(config)


def config_dtype(config: dict) -> str:
    """A config.json's saved dtype; float32 when it names none (or one jaxserve cannot run)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


def resolve_dtype(requested, model: str | None):
    """`requested` ("auto", a dtype name or a dtype) for `model` (a reference as
    `load_model` takes it) on this machine; the checkpoint is read only when it decides."""
    if not isinstance(requested, str) or requested != "auto":
        return requested
    import jax

    from jaxserve.weights.load import resolve_source

    backend = jax.default_backend()
    return choose_dtype(requested, "float32" if backend == "cpu" else checkpoint_dtype(resolve_source(model)), backend)
