"""A Hugging Face fast tokenizer built from a GGUF file's metadata, without PyTorch.

transformers can read a GGUF tokenizer too, but its reader needs torch (a test-only
dependency here) and ignores llama.cpp's pre-tokenizer type. This builds byte-level BPE
tokenizers (`tokenizer.ggml.model == "gpt2"`) directly with the `tokenizers` library:
vocabulary and merges from the file, control tokens as special tokens, and the
pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`.
"""

from __future__ import annotations

from typing import Any

from jaxserve.config import UnsupportedModelError

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp pre-tokenizer types that split every digit before the GPT-2 regex.
_DIGIT_SPLITTING = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PLAIN_GPT2 = {"default", "gpt2", "mpt", "olmo", "jais"}


def tokenizer_from_gguf(field) -> Any:
    """A transformers PreTrainedTokenizerFast; `field(key, default)` reads GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = field("tokenizer.ggml.model")
    pre = field("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _DIGIT_SPLITTING | _PLAIN_GPT2:
        raise UnsupportedModelError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (byte-level BPE with "
            f"pre-tokenizer {sorted(_DIGIT_SPLITTING | _PLAIN_GPT2)} is); use the model's Hugging Face folder"
        )
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(field("tokenizer.ggml.add_space_prefix", False)),
                                          use_regex=True)
    if pre in _DIGIT_SPLITTING:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED])

    def special(key):
        index = field(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    # llama.cpp adds BOS (and, rarely, EOS) around a text prompt when the file says so.
    ends = [(key, field(f"tokenizer.ggml.{key}_token_id")) for key in ("bos", "eos")
            if field(f"tokenizer.ggml.add_{key}_token", False)]
    if ends:
        def template(piece):
            return " ".join([f"{tokens[i]}:0" for key, i in ends if key == "bos"] + [piece]
                            + [f"{tokens[i]}:0" for key, i in ends if key == "eos"])
        tok.post_processor = processors.TemplateProcessing(
            single=template("$A"), pair=template("$A") + " " + template("$B:1"),
            special_tokens=[(tokens[i], i) for _, i in ends])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("bos"), eos_token=special("eos"), unk_token=special("unknown"),
        pad_token=special("padding"), chat_template=field("tokenizer.chat_template"),
    )
