"""A GGUF file with its weight matrices re-quantized to another block type (Q8_0 unless --type).

The benchmarks need the default model as a Q8_0 file (the package ships its Q4_1 one): every
2-D tensor whose rows split into whole blocks is dequantized and quantized again with the
`gguf` package; norms, biases and the metadata (tokenizer, chat template) are copied as they
are, and `general.file_type` names the new type. The values are the source's re-rounded,
not a quantization of the original float weights: fine for timing, and llama.cpp and
jaxserve then read the same blocks.

    python benchmarks/requantize_gguf.py SRC.gguf DST.gguf [--type Q8_0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1"}


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
    p.add_argument("--type", default="Q8_0", choices=sorted(FILE_TYPES), help="the block type to write")
    args = p.parse_args(argv)
    changed = requantize(args.src, args.dst, args.type)
    print(f"{args.dst}: {changed} tensors as {args.type}, {args.dst.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
