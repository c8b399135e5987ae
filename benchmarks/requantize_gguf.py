"""A GGUF file with its weight matrices re-quantized to another block type (Q8_0 unless --type).

The benchmarks need the default model as a Q8_0 file (the package ships its Q4_1 one): every
2-D tensor whose rows split into whole blocks is dequantized and quantized again with the
`gguf` package; norms, biases and the metadata (tokenizer, chat template) are copied as they
are, and `general.file_type` names the new type. The values are the source's re-rounded,
not a quantization of the original float weights: fine for timing, and llama.cpp and
jaxserve then read the same blocks.

    python benchmarks/requantize_gguf.py SRC.gguf DST.gguf [--type Q8_0|Q4_0|Q4_1|F32]

The K-quant mixes people download (Q4_K_M, Q5_K_M, ...) are made by llama.cpp's own
quantizer, which the `gguf` package lacks: with `--llama-cpp-python` (the venv of
benchmarks/install_llama_cpp.sh) the source is written as F32 first and
`llama_model_quantize` makes DST from it, choosing each tensor's type as llama.cpp does
(for the default model's rows of 576, not a multiple of 256: Q5_0 and Q8_0 where Q4_K and
Q6_K do not fit).

    python benchmarks/requantize_gguf.py SRC.gguf DST.gguf --type Q4_K_M --llama-cpp-python .venv-llama-cpp/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "F32": "ALL_F32"}
LLAMA_CPP_TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q3_K_M")
# Run in llama.cpp's venv: its quantizer on argv[1] -> argv[2], file type argv[3] (LLAMA_FTYPE_MOSTLY_*).
QUANTIZE_SCRIPT = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) != 0:
    raise SystemExit("llama_model_quantize failed")
"""


def requantize(src: Path, dst: Path, qtype_name: str) -> int:
    """Write `dst`; returns how many tensors were re-quantized."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer's own header fields, and the one that changes
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[qtype_name]])
    changed = 0
    for t in reader.tensors:
        if len(t.shape) == 2 and int(t.shape[0]) % block == 0:  # ne0: the values along a row
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
            changed += 1
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument(
        "--type", default="Q8_0", choices=sorted(FILE_TYPES) + list(LLAMA_CPP_TYPES), help="the block type to write"
    )
    p.add_argument("--llama-cpp-python", help="Python of llama.cpp's venv: its quantizer makes the K-quant mixes")
    args = p.parse_args(argv)
    if args.type in LLAMA_CPP_TYPES:
        if not args.llama_cpp_python or not Path(args.llama_cpp_python).is_file():
            p.error(f"--type {args.type} is made by llama.cpp: pass --llama-cpp-python (see install_llama_cpp.sh)")
        with tempfile.TemporaryDirectory() as tmp:
            f32 = Path(tmp) / "f32.gguf"
            requantize(args.src, f32, "F32")
            cmd = [args.llama_cpp_python, "-c", QUANTIZE_SCRIPT, str(f32), str(args.dst), args.type]
            subprocess.run(cmd, check=True)
        print(f"{args.dst}: {args.type} by llama.cpp, {args.dst.stat().st_size / 2**20:.1f} MiB")
        return 0
    changed = requantize(args.src, args.dst, args.type)
    print(f"{args.dst}: {changed} tensors as {args.type}, {args.dst.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
