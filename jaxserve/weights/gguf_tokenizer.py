"""A Hugging Face fast tokenizer built from a GGUF file's metadata, without PyTorch.

transformers can read a GGUF tokenizer too, but its reader needs torch (a test-only
dependency here). This builds the two kinds llama.cpp files carry directly with the
`tokenizers` library:

- byte-level BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM, Llama 3, Qwen 2/3): vocabulary
  and merges from the file, split into words by the regex llama.cpp uses for the file's
  `tokenizer.ggml.pre`;
- SentencePiece BPE (`"llama"`: Llama 2, Mistral, TinyLlama): spaces as `▁`, a `▁` before
  the text, bytes (`<0x41>`) for characters outside the vocabulary, and merges ranked by
  the scores of the pieces they make when the file lists none (llama.cpp merges by score).

Control tokens become special tokens, user-defined ones added tokens.
"""

from __future__ import annotations

from typing import Any

from jaxserve.model.config import UnsupportedModelError
from jaxserve.weights.fast_tokenizer import fast_tokenizer_class

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp pre-tokenizer types that split every digit before the GPT-2 regex.
_DIGIT_SPLITTING = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PLAIN_GPT2 = {"default", "gpt2", "mpt", "olmo", "jais"}
# llama.cpp's word-splitting regexes (llama-vocab.cpp); they differ only in how digits group.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLIT = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_BYTE_LEVEL_PRE = _DIGIT_SPLITTING | _PLAIN_GPT2 | set(_REGEX_SPLIT)
SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def tokenizer_from_gguf(field) -> Any:
    """A transformers PreTrainedTokenizerFast; `field(key, default)` reads GGUF metadata."""
    from tokenizers import AddedToken, processors

    kind = field("tokenizer.ggml.model")
    pre = field("tokenizer.ggml.pre", "default")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type", [1] * len(tokens))
    if kind == "gpt2" and pre in _BYTE_LEVEL_PRE:
        tok = _byte_level_bpe(field, tokens, pre)
    elif kind == "llama":
        tok = _sentencepiece_bpe(field, tokens)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (SentencePiece 'llama', or "
            f"byte-level BPE 'gpt2' with pre-tokenizer {sorted(_BYTE_LEVEL_PRE)} is); use the model's Hugging Face "
            f"folder"
        )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED])

    def special(key):
        index = field(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    # llama.cpp adds BOS (and, rarely, EOS) around a text prompt when the file says so;
    # a SentencePiece file that says nothing gets BOS.
    ends = [
        (key, field(f"tokenizer.ggml.{key}_token_id"))
        for key in ("bos", "eos")
        if field(f"tokenizer.ggml.add_{key}_token", kind == "llama" and key == "bos")
        and field(f"tokenizer.ggml.{key}_token_id") is not None
    ]
    if ends:

        def template(piece):
            return " ".join(
                [f"{tokens[i]}:0" for key, i in ends if key == "bos"]
                + [piece]
                + [f"{tokens[i]}:0" for key, i in ends if key == "eos"]
            )

        tok.post_processor = processors.TemplateProcessing(
            single=template("$A"),
            pair=template("$A") + " " + template("$B:1"),
            special_tokens=[(tokens[i], i) for _, i in ends],
        )

    return fast_tokenizer_class()(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=field("tokenizer.chat_template"),
    )


def _byte_level_bpe(field, tokens: list[str], pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    if pre in _REGEX_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLIT[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        byte_level = pre_tokenizers.ByteLevel(
            add_prefix_space=bool(field("tokenizer.ggml.add_space_prefix", False)), use_regex=True
        )
        if pre in _DIGIT_SPLITTING:
            byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(field, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    listed = field("tokenizer.ggml.merges")
    if listed:
        merges = [tuple(m.split(" ", 1)) for m in listed]
    else:
        merges = merges_by_score(tokens, field("tokenizer.ggml.scores", [0.0] * len(tokens)))
    unk = field("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    # NOTE: a normalizer, not a Metaspace pre-tokenizer: like llama.cpp (and SentencePiece) it puts
    # a space before every run of text, even one that starts with a space or follows a special
    # token, and keeps the text one word (SentencePiece merges across spaces: "▁▁", "▁the").
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece tokenizer, which repeatedly joins
    the neighbouring pair whose joined piece scores highest: every split of every piece
    into two pieces, best-scoring result first (ties: longer left part first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found += [(score, len(left), len(right), left, right) for left, right in splits]
    found.sort(key=lambda m: m[:3], reverse=True)  # stable: file order within ties
    return [(left, right) for *_, left, right in found]
