"""A Hugging Face folder of a model with calibrated KV-cache scales, as llm-compressor writes them.

llm-compressor's static KV-cache scheme (compressed-tensors `kv_cache_scheme`) records the
largest |K| (after RoPE) and |V| of every attention layer over calibration text and stores
`k_scale` = that maximum / 448 (fp8) or / 127 (int8), per layer or per layer and KV head.
This script does the same with transformers on the CPU, so that benchmarks/quality.py can
measure what such a checkpoint costs against the cache's own scale per token:

    python benchmarks/calibrate_kv_scales.py OUT [--model GGUF_OR_FOLDER] [--strategy tensor|attn_head]
    python benchmarks/quality.py --model OUT --quantization "" --kv-cache-dtype fp8,int8

The calibration text is the spec-decode prompt sets (benchmarks/prompts), held out from
quality.py's scored text. The weights are saved in float32 as transformers reads them (for
the default model: its dequantization of the Q4_1 GGUF).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Python puts this file's folder first on sys.path, where benchmarks/kernels.py would shadow
# the `kernels` package that transformers probes for.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if not p or Path(p).resolve() != ROOT / "benchmarks"]

PROMPT_SETS = tuple(ROOT / "benchmarks" / "prompts" / f"spec_{name}.jsonl" for name in ("chat", "repetitive"))
QMAX = {"float": 448.0, "int": 127.0}


def recording_cache(config, amax: dict):
    """A transformers cache that folds each layer's largest |K| and |V| per KV head into
    `amax` (layer -> (K's [KV], V's [KV]))."""
    import torch
    import transformers

    class RecordingCache(transformers.DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            # [batch, KV, tokens, head_dim] -> [KV]
            seen = tuple(x.detach().abs().amax(dim=(0, 2, 3)) for x in (key_states, value_states))
            old = amax.get(layer_idx)
            amax[layer_idx] = seen if old is None else tuple(torch.maximum(a, b) for a, b in zip(old, seen))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return RecordingCache(config=config)


def calibrate(model, token_lists, strategy: str, kind: str = "float"):
    """(k_scale, v_scale) per layer for `kind` ("float": fp8, "int": int8): [1] per tensor,
    [KV, 1, 1] per KV head (compressed-tensors' shapes), from a forward pass over each of
    `token_lists`."""
    import torch

    amax: dict = {}
    with torch.no_grad():
        for tokens in token_lists:
            model(torch.tensor([tokens]), cache=recording_cache(model.config, amax))
    scales = {}
    for layer, (k, v) in sorted(amax.items()):
        per_head = (k / QMAX[kind], v / QMAX[kind])
        scales[layer] = tuple(s.reshape(-1, 1, 1) if strategy == "attn_head" else s.max().reshape(1) for s in per_head)
    return scales


def write_folder(model, tokenizer, scales, out: Path, strategy: str, kind: str) -> None:
    """`model` saved to `out` with `scales` and a compressed-tensors config that quantizes only the KV cache."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from safetensors.torch import save_file

    # NOTE: by hand, not save_pretrained: transformers refuses to save a model it read from a GGUF.
    out.mkdir(parents=True, exist_ok=True)  # main() refuses a folder that exists
    shared = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # safetensors keeps one copy
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items() if n not in shared}
    for layer, (k_scale, v_scale) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = k_scale.float().contiguous()
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = v_scale.float().contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    args = QuantizationArgs(num_bits=8, type=kind, strategy=strategy, dynamic=False, symmetric=True)
    spec = QuantizationConfig(config_groups={}, kv_cache_scheme=args, quantization_status="frozen")
    config = model.config.to_dict()
    config["quantization_config"] = {**spec.model_dump(mode="json"), "quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def calibration_tokens(tokenizer, vocab_size: int) -> list[list[int]]:
    """Each prompt of the spec-decode sets, chat-templated as the engine does."""
    from jaxserve.engine.tokenization import encode_chat

    out = []
    for path in PROMPT_SETS:
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(encode_chat(tokenizer, json.loads(line)["messages"], vocab_size)[1])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the folder to write (must not exist)")
    p.add_argument("--model", default=None, help="a HF folder or .gguf file (default: the embedded model)")
    p.add_argument("--strategy", choices=("tensor", "attn_head"), default="tensor", help="per layer, or per KV head")
    p.add_argument("--type", choices=("float", "int"), default="float", help="calibrate for fp8 (float) or int8 (int)")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.weights.load import resolve_source

    if args.out.exists():
        p.error(f"{args.out} exists")
    source = resolve_source(args.model)
    gguf = {"gguf_file": source.name} if source.is_file() else {}
    folder = source.parent if source.is_file() else source
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **gguf).eval()
    tokens = calibration_tokens(tokenizer, model.config.vocab_size)
    scales = calibrate(model, tokens, args.strategy, args.type)
    write_folder(model, tokenizer, scales, args.out, args.strategy, args.type)
    k_range = [float(k.max()) for k, _ in scales.values()]
    print(
        f"{args.out}: {len(scales)} layers calibrated on {len(tokens)} prompts ({sum(map(len, tokens))} tokens); "
        f"k_scale {min(k_range):.4g} to {max(k_range):.4g}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
