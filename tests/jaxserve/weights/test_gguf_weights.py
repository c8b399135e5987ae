"""Logits of models read from GGUF files against transformers reading the same file.

The files are tiny random `llama`, `qwen2` (QKV bias, tied embeddings) and `qwen3`
(Q/K norms) models written here with the `gguf` package. Q8_0 and Q4_0 tensors are
quantized by `gguf.quants.quantize`; the package cannot quantize to Q4_K or Q6_K, so those
tensors are random blocks (scaled to sensible weights) written as raw bytes. The oracle is
transformers' own GGUF loader (its own dequantizer, not the `gguf` package's that ours
calls, and its own undoing of llama.cpp's Q/K rotary permutation).
"""

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.weights import load_model
from tests.jaxserve.model.test_model_vs_hf import jitted_step
from tests.paged import PagedSequences

# Row lengths (the hidden size, the MLP width, heads x head_dim) are multiples of 256, the
# K-quants' block; 32 would do for Q8_0 / Q4_0.
GEOMETRY = {
    "llama": dict(heads=4, kv_heads=2, head_dim=64, tied=False),
    "qwen2": dict(heads=4, kv_heads=2, head_dim=64, tied=True),
    "qwen3": dict(heads=2, kv_heads=1, head_dim=128, tied=False),
}
HIDDEN, FFN, LAYERS, VOCAB = 256, 512, 2, 300
PROMPT = [5, 17, 260, 3, 99, 42, 42, 7, 150, 1, 288, 64]
QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_K", "Q6_K"]


def small_vocabulary() -> dict:
    """A small byte-level BPE vocabulary as GGUFWriter `add_*` calls (the loader builds the
    tokenizer too)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    pairs = [(a, b) for a in "etaoinsh" for b in "rdlucmfw"][: VOCAB - 256 - 2]
    tokens = alphabet + [a + b for a, b in pairs] + ["<|bos|>", "<|eos|>"]
    return dict(
        tokenizer_model="gpt2",
        tokenizer_pre="default",
        token_list=tokens,
        token_merges=[f"{a} {b}" for a, b in pairs],
        token_types=[1] * (VOCAB - 2) + [3, 3],
        bos_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1,
    )


def random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K blocks whose values come out near N(0, 1/cols)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # The f16 super-block scales: d and dmin lead a Q4_K or Q5_K block; d ends a Q6_K block.
    scale_at = [slice(0, 2), slice(2, 4)] if qtype.name in ("Q4_K", "Q5_K") else [slice(size - 2, size)]
    for at in scale_at:
        data[..., at] = np.full((rows, cols // block, 1), 1.0, np.float16).view(np.uint8)
    spread = dequantize(data.reshape(rows, -1), qtype).std()
    for at in scale_at:
        d = (rng.uniform(0.5, 1.5, (rows, cols // block, 1)) / (spread * cols**0.5)).astype(np.float16)
        data[..., at] = d.view(np.uint8)
    return data.reshape(rows, -1)


def write_tiny_gguf(
    path, arch: str, qtype_name: str, seed: int = 0, vocabulary: dict | None = None, types: dict | None = None
) -> None:
    """A random model; `vocabulary`: its tokenizer as GGUFWriter `add_*` calls (default:
    small_vocabulary()); `types`: block types of some tensors by GGUF name (the rest `qtype_name`)."""
    import gguf

    vocabulary = vocabulary or small_vocabulary()
    vocab = len(vocabulary["token_list"])

    g = GEOMETRY[arch]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(g["heads"])
    writer.add_head_count_kv(g["kv_heads"])
    writer.add_key_length(g["head_dim"])
    writer.add_value_length(g["head_dim"])
    writer.add_rope_dimension_count(g["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for method, value in vocabulary.items():
        getattr(writer, f"add_{method}")(value)

    def matrix(name, rows, cols):
        type_name = (types or {}).get(name, qtype_name)
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name in ("Q4_K", "Q5_K", "Q6_K"):
            writer.add_tensor(name, random_k_blocks(rows, cols, qtype, rng), raw_dtype=qtype)
        else:
            weights = (rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)

    def vector(name, n, around):
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q, kv = g["heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"]
    matrix("token_embd.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        matrix(f"blk.{i}.attn_q.weight", q, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", kv, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        if arch == "qwen2":
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                vector(f"blk.{i}.{name}.bias", n, 0.0)
        if arch == "qwen3":
            vector(f"blk.{i}.attn_q_norm.weight", g["head_dim"], 1.0)
            vector(f"blk.{i}.attn_k_norm.weight", g["head_dim"], 1.0)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, q)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    vector("output_norm.weight", HIDDEN, 1.0)
    if not g["tied"]:
        matrix("output.weight", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def our_logits(loaded, prompt) -> np.ndarray:
    step, state = jitted_step(loaded.model)
    seqs = PagedSequences([len(prompt)], 4, num_blocks=8)
    kv = allocate_kv_cache(loaded.config, 8, 4, jnp.float32)
    logits, _ = step(state, kv, seqs.step([prompt], [(0, len(prompt))], pad_to=16, all_logits=True))
    return np.asarray(logits, np.float64)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("arch", sorted(GEOMETRY))
def test_logits_equal_transformers_reading_the_same_gguf(tmp_path, arch, qtype):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{arch}-{qtype}.gguf"
    write_tiny_gguf(path, arch, qtype)
    loaded = load_model(str(path), use_cache=False, progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert type(theirs).__name__ == loaded.hf_config["architectures"][0]
    with torch.no_grad():
        want = theirs(torch.tensor([PROMPT])).logits[0].double().numpy()
    got = our_logits(loaded, PROMPT)
    assert np.abs(want).max() > 1.0, "logits too flat for the comparison to mean anything"
    err = np.abs(got - want).max()
    assert err <= 1e-4, f"max abs error {err:.2e}"


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_weights_equal_transformers_torch_dequantizer(tmp_path, qtype):
    """transformers reads these architectures' tensors with the `gguf` package's dequantizer,
    as ours does, so the blocks are checked apart: every weight we load against
    transformers' own torch dequantizer of the file's bytes (qwen3: no rotary permutation)."""
    from flax import nnx
    from gguf import GGUFReader
    from transformers.integrations.gguf.dequant import dequantize

    from jaxserve.weights.gguf_reader import hf_name
    from jaxserve.weights.params import _hf_name, flatten_tree

    path = tmp_path / f"tiny-qwen3-{qtype}.gguf"
    write_tiny_gguf(path, "qwen3", qtype)
    loaded = load_model(str(path), use_cache=False, progress=False)
    ours = {
        _hf_name(p): np.asarray(v).T if p[-1] == "kernel" else np.asarray(v)
        for p, v in flatten_tree(nnx.to_pure_dict(nnx.state(loaded.model)))
    }
    checked = set()
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if t.tensor_type.name == "F32":  # norms, stored as they are
            want = np.asarray(t.data).reshape(shape)
        else:
            raw = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8))  # a writable copy
            want = dequantize(raw, int(t.tensor_type), torch.float32).reshape(shape).numpy()
        np.testing.assert_allclose(ours[hf_name(t.name)], want, rtol=1e-6, atol=1e-7, err_msg=t.name)
        checked.add((t.name, t.tensor_type.name))
    assert sum(kind == qtype for _, kind in checked) == 2 + 7 * LAYERS  # embeddings, output, projections
    assert len(checked) == len(ours)


def test_a_sentencepiece_gguf_serves_like_transformers(tmp_path):
    """The whole path for a Mistral / TinyLlama-style file (llama weights, SentencePiece
    vocabulary with byte fallback): prompt ids, greedy tokens and text against transformers
    reading the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.engine.llm import LLM
    from scheduler import SamplingParams
    from tests.jaxserve.weights.test_gguf_tokenizer import sentencepiece_fields

    path = tmp_path / "tiny-llama-sentencepiece.gguf"
    write_tiny_gguf(path, "llama", "Q8_0", vocabulary=sentencepiece_fields())
    llm = LLM(
        str(path),
        cache_dir=tmp_path / "cache",
        max_num_seqs=1,
        max_num_batched_tokens=32,
        max_model_len=48,
        num_blocks=16,
    )
    prompt = "Привет, мир! The dog 🙂 sleeps"
    # NOTE: 12 tokens stop short of a byte run (<0x15><0x3D><0x43><0xC7>) that `tokenizers`'
    # ByteFallback decodes as four U+FFFD in one piece but as "\x15=C" + U+FFFD token by token.
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids, gen = tok.encode(prompt), out.outputs[0].token_ids
    assert out.prompt_token_ids == ids and ids[0] == tok.bos_token_id
    with torch.no_grad():
        logits = theirs(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1].double().numpy()
    for step, (token, row) in enumerate(zip(gen, logits)):
        assert row[token] >= row.max() - 1e-4, f"step {step}: {token} is not transformers' greedy token"
    assert len(gen) == 12 and {"<0x98>", "\u2581The"} <= set(tok.convert_ids_to_tokens(gen))
    text = tok.decode(ids + gen, skip_special_tokens=True)
    assert text == tok.decode(ids, skip_special_tokens=True) + out.outputs[0].text


def test_a_gguf_config_is_parsed_once_then_remembered(tmp_path, monkeypatch):
    from jaxserve.weights import load
    from jaxserve.weights.gguf_reader import GGUFFile

    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", "Q8_0")
    first, _ = load.read_hf_config(str(path))
    assert first == GGUFFile(path).hf_config()

    def parse_again(path):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(load, "GGUFFile", parse_again)
    assert load.read_hf_config(str(path))[0] == first
    monkeypatch.undo()
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(path, "qwen2", "Q8_0")  # the same path, another model: read anew
    assert load.read_hf_config(str(path))[0] == GGUFFile(path).hf_config() != first


def file_values(t) -> np.ndarray:
    """A GGUF tensor's float values [out, in] as a decoder we did not write computes them:
    transformers' torch dequantizer, or for the block types it lacks (Q5_0) the gguf package's."""
    from gguf import dequantize as gguf_dequantize
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize

    shape = tuple(int(n) for n in reversed(t.shape))
    if int(t.tensor_type) not in GGML_BLOCK:
        return gguf_dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    raw = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8))  # a writable copy
    return dequantize(raw, int(t.tensor_type), torch.float32).reshape(shape).numpy()


def kept_values(layer) -> np.ndarray:
    """A quantized layer's weight [in, out] as its int4 or int8 values and scales give it."""
    from pallas_kernels.quantized_matmul import dequantize_int4

    if layer.kind == "int4":
        return np.asarray(dequantize_int4(layer.packed[...], layer.scales[...], layer.offsets[...]))
    group = layer.din // layer.scales.shape[0]  # float32 holds each f16 scale times an int8 value exactly
    values = np.asarray(layer.weight[...], np.float32) * np.repeat(np.asarray(layer.scales[...]), group, axis=0)
    if layer.kind == "int8_asym":  # then the offset added, as the file's dequantizers do
        values += np.repeat(np.asarray(layer.offsets[...]), group, axis=0)
    return values


def transformers_logits(path) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return theirs(torch.tensor([PROMPT])).logits[0].double().numpy()


@pytest.mark.parametrize(
    "qtype, kind, group",
    [
        ("Q4_K", "int4", 32),
        ("Q8_0", "int8", 32),
        ("Q5_0", "int8", 32),
        ("Q5_1", "int8_asym", 32),
        ("Q5_K", "int8_asym", 32),
        ("Q6_K", "int8", 16),
    ],
)
def test_projections_are_served_as_the_files_own_values(tmp_path, qtype, kind, group):
    """`--quantization gguf` keeps a Q4_K projection's blocks as int4 with group 32 (its
    sub-blocks' scales and mins), a Q8_0 or Q5_0 file's as int8 with group 32 (Q5_0's five
    bits less 16), Q5_1's and Q5_K's as int8 with an offset per 32 (their five bits, scale and
    min) and a Q6_K file's as int8 with group 16 (its 16-value scales times d),
    instead of re-rounding them: every kept weight dequantizes to the file's values (a
    decoder we did not write), and the logits (llama: the rotary permutation applied to kept
    weights) equal transformers reading the file."""
    from gguf import GGUFReader

    from jaxserve.model.quantization import quantized_layers
    from jaxserve.weights.gguf_reader import hf_name

    path = tmp_path / f"tiny-qwen3-{qtype}.gguf"
    write_tiny_gguf(path, "qwen3", qtype)
    loaded = load_model(str(path), use_cache=False, progress=False, quantization="gguf")
    assert (loaded.quantization.kind, loaded.quantization.group_size, loaded.quantization.exceptions) == (
        kind,
        group,
        (),
    )
    layers = {f"model.{path.replace('/', '.')}.weight": m for path, m in quantized_layers(loaded.model)}
    kept = 0
    for t in GGUFReader(str(path)).tensors:
        if t.tensor_type.name != qtype or hf_name(t.name) not in layers:
            continue
        layer = layers[hf_name(t.name)]
        assert layer.kind == kind and layer.scales.shape[0] == layer.din // group, t.name
        np.testing.assert_array_equal(kept_values(layer), file_values(t).T, err_msg=t.name)
        kept += 1
    assert kept == 7 * LAYERS

    path = tmp_path / f"tiny-llama-{qtype}.gguf"
    write_tiny_gguf(path, "llama", qtype)
    loaded = load_model(str(path), use_cache=False, progress=False, quantization="gguf")
    want = transformers_logits(path)
    err = np.abs(our_logits(loaded, PROMPT) - want).max()
    assert np.abs(want).max() > 1.0 and err <= 1e-4, f"max abs error {err:.2e}"


# A Q4_K_M-style file: Q4_K projections, some v and down projections in Q6_K (llama.cpp's
# "more bits" layers), and the fallbacks llama.cpp takes where a row is not a multiple of 256
# (Q5_0 for Q4_K, Q8_0 for Q6_K); a Q5_K_M's Q5_K and Q5_1.
MIXED = {
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_k.weight": "Q5_0",
    "blk.1.ffn_up.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "Q5_1",
    "blk.1.attn_output.weight": "Q5_K",
}


@pytest.mark.parametrize("matmul", ["reference", "cpu"])
def test_a_file_that_mixes_block_types_keeps_each_projection_in_its_own_layout(tmp_path, matmul):
    """A Q4_K_M-style file keeps every projection's own values: its Q4_K ones as int4 with
    group 32, its Q6_K ones as int8 with group 16, Q5_0 and Q8_0 as int8 with group 32, Q5_1
    and Q5_K as int8 with an offset per 32 (before,
    the whole model took int4 and the Q6_K layers lost two bits). Every weight dequantizes to
    the file's values, the logits equal transformers reading the file, through the reference
    and through the CPU kernels (which take each layer's layout), and the weight cache
    restores the same layers."""
    from gguf import GGUFReader

    from jaxserve.model.quantization import quantized_layers
    from jaxserve.runner.kernels import select_matmul
    from jaxserve.weights.gguf_reader import hf_name

    path = tmp_path / "tiny-llama-Q4_K_M.gguf"
    write_tiny_gguf(path, "llama", "Q4_K", types=MIXED)
    loaded = load_model(str(path), use_cache=True, cache_dir=tmp_path / "cache", progress=False, quantization="gguf")
    quant = loaded.quantization
    assert (quant.kind, quant.group_size) == ("int4", 32)
    assert quant.label == (
        "gguf (int4, group 32; 2 projections int8, group 16; 2 projections int8, group 32; "
        "2 projections int8_asym, group 32)"
    )
    layouts = {"Q4_K": ("int4", 32), "Q6_K": ("int8", 16), "Q5_0": ("int8", 32), "Q8_0": ("int8", 32)}
    layouts |= {"Q5_1": ("int8_asym", 32), "Q5_K": ("int8_asym", 32)}
    layers = {f"model.{path.replace('/', '.')}.weight": m for path, m in quantized_layers(loaded.model)}
    kept = 0
    for t in GGUFReader(str(path)).tensors:
        if hf_name(t.name) not in layers:
            continue
        layer = layers[hf_name(t.name)]
        kind, group = layouts[t.tensor_type.name]
        assert (layer.kind, layer.din // layer.scales.shape[0]) == (kind, group), t.name
        if t.name.split(".")[-2] not in ("attn_q", "attn_k"):  # llama: Q and K rows permuted (the logits check those)
            np.testing.assert_array_equal(kept_values(layer), file_values(t).T, err_msg=t.name)
            kept += 1
    assert kept == 5 * LAYERS

    restored = load_model(str(path), use_cache=True, cache_dir=tmp_path / "cache", progress=False, quantization="gguf")
    assert restored.from_cache and restored.quantization == quant
    assert select_matmul(matmul, restored.model) == matmul
    want = transformers_logits(path)
    err = np.abs(our_logits(restored, PROMPT) - want).max()
    assert np.abs(want).max() > 1.0 and err <= 1e-4, f"max abs error {err:.2e}"


def test_a_file_without_4_bit_projections_keeps_int8_and_re_quantizes_the_rest_to_it(tmp_path, caplog):
    """An F16 file under `--quantization gguf` has no block type int8 holds exactly and none
    that is 4-bit: its projections are re-quantized to int8 with group 32 (said in the log),
    which stays far closer to the file than the int4 this used to take."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny-llama-F16.gguf"
    write_tiny_gguf(path, "llama", "F16")
    with caplog.at_level(logging.WARNING, logger="jaxserve.weights.gguf_reader"):
        loaded = load_model(str(path), use_cache=False, progress=False, quantization="gguf")
    assert (loaded.quantization.kind, loaded.quantization.group_size) == ("int8", 32)
    want_log = f"{7 * LAYERS} F16 projections were re-quantized to gguf (int8, group 32)"
    assert f"{want_log} (no layout holds F16 blocks exactly)" in caplog.text
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(torch.tensor([PROMPT])).logits[0].double().numpy()
    int4 = load_model(str(path), use_cache=False, progress=False, quantization="int4")
    err, err_int4 = (np.abs(our_logits(m, PROMPT) - want).max() for m in (loaded, int4))
    assert err <= 0.1 * err_int4, f"max abs error {err:.2e} (int8) against {err_int4:.2e} (int4)"  # 7e-2, 1.7
