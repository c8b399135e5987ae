"""The reasoning parsers: vLLM's own test inputs as the oracle for the split, and the
unstreamed split as the oracle for the streamed one, whatever the pieces.

Cases: tests/api/reasoning_parser_cases.json (vLLM's tests/reasoning/ inputs and expected
outputs, transcribed as data; each case names its source). vLLM writes an empty reasoning
as "" or None depending on the path; our interface says None, so both count as empty.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

CASES = json.loads((Path(__file__).parent / "reasoning_parser_cases.json").read_text())["cases"]

# Our own edge cases for the streaming property (no expected split: `extract` is the oracle).
EDGE_OUTPUTS = [
    "",
    " ",
    "<",
    "<thi",
    "  <think>",
    "\n<think>\n",
    "<think></think>",
    "</thin",
    "a</think",
    "a</think>",
    "</think></think>x",
    "<think><think>a</think>b</think>c",
    "x <think> y</think>z",
    "<<think>a",
    "a<</think>b",
    "<tool_call>",
    "a<tool_call>\n\n",
    "a<tool_call> <functio",
    "a<tool_call> <function",
    "a<tool_call> <functionX</think>b",
    "a<tool_call>\n<function=f>b</think>c",
    "a<tool_call>x<tool_call>\n<function name='f'>",
    "<tool_call></think>b",
    "r<tool_call>\n</think>c",
]
SPLITS = {"chars": 1, "chunks3": 3, "chunks7": 7, "whole": None}


def make_parser(case: dict) -> ReasoningParser:
    return get_reasoning_parser(case["parser"])(None).for_request(case.get("chat_template_kwargs"))


def pieces(text: str, size: int | None) -> list[str]:
    if size is None:
        return [text]
    return [text[i : i + size] for i in range(0, len(text), size)]


def streamed(parser: ReasoningParser, parts: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning, content = "", ""
    for part in parts:
        r, c = stream.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


def property_cases():
    for case in CASES:
        yield pytest.param(case, id=f"{case['parser']}-{case['name']}")
    for name in REASONING_PARSERS:
        for i, text in enumerate(EDGE_OUTPUTS):
            yield pytest.param({"parser": name, "output": text}, id=f"{name}-edge{i}")
    for i, text in enumerate(EDGE_OUTPUTS):
        case = {"parser": "qwen3", "output": text, "chat_template_kwargs": {"enable_thinking": False}}
        yield pytest.param(case, id=f"qwen3-nothinking-edge{i}")


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c['parser']}-{c['name']}") for c in CASES])
def test_extract_matches_vllm(case):
    reasoning, content = make_parser(case).extract(case["output"])
    assert (reasoning or "", content or "") == (case["reasoning"] or "", case["content"] or "")
    assert reasoning != "" and content != "", "empty is None"


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("case", list(property_cases()))
def test_streamed_pieces_add_up_to_the_unstreamed_split(case, split):
    parser = make_parser(case)
    reasoning, content = parser.extract(case["output"])
    assert streamed(parser, pieces(case["output"], SPLITS[split])) == (reasoning or "", content or "")


@pytest.mark.parametrize("case", [pytest.param(c, id=c["name"]) for c in CASES if "deltas" in c])
def test_vllms_multi_token_deltas(case):
    expected = (case["reasoning"] or "", case["content"] or "")
    assert streamed(make_parser(case), case["deltas"]) == expected


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_the_stream_holds_back_only_what_may_be_a_marker(name):
    stream = get_reasoning_parser(name)(None).stream()
    assert stream.feed(" ") == ("", "")  # may still be whitespace before an opening <think>
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>Hello") == ("Hello", "")
    assert stream.feed(" <thin") == (" <thin", "")  # a <think> inside the thinking is text
    assert stream.feed("g </") == ("g ", "")
    assert stream.feed("b> and </thi") == ("</b> and ", "")
    assert not stream.ended
    assert stream.feed("nk>") == ("", "")
    assert stream.ended
    assert stream.feed("Answer </think>") == ("", "Answer </think>")
    assert stream.finish() == ("", "")


def test_qwen3_holds_a_tool_call_until_a_function_tag_confirms_it():
    stream = get_reasoning_parser("qwen3")(None).stream()
    assert stream.feed("Plan.<tool_call>\n ") == ("Plan.", "")
    assert stream.feed("<func") == ("", "")
    assert stream.feed("tion=f>") == ("", "<tool_call>\n <function=f>")
    assert stream.ended
    stream = get_reasoning_parser("qwen3")(None).stream()
    assert stream.feed("Plan.<tool_call>\n ") == ("Plan.", "")
    assert stream.feed("{") == ("<tool_call>\n {", "")  # hermes-style JSON: not an end
    assert stream.finish() == ("", "")


def test_qwen3_with_thinking_off_is_all_content():
    parser = get_reasoning_parser("qwen3")(None)
    off = parser.for_request({"enable_thinking": False})
    assert parser.for_request(None) is parser and parser.for_request({"enable_thinking": True}) is parser
    assert parser.starts_in_reasoning() and not off.starts_in_reasoning()
    assert off.extract("Hi") == (None, "Hi")
    stream = off.stream()
    assert stream.ended and stream.feed("<") == ("", "<")
    assert get_reasoning_parser("deepseek_r1")(None).for_request({"enable_thinking": False}).starts_in_reasoning()


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert all(get_reasoning_parser(name).name == name for name in REASONING_PARSERS)
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


def test_without_a_tokenizer_the_markers_have_no_ids():
    parser = get_reasoning_parser("deepseek_r1")(None)
    assert parser.end_token_id is None and parser.start_token_id is None


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    """The tiny one-token-per-character tokenizer with `<think>` and `</think>` added as
    special tokens (no model of ours has them, and nothing is downloaded)."""
    from transformers import AutoTokenizer

    from tests.tiny_models import make_tiny_char_tokenizer

    folder = tmp_path_factory.mktemp("think-tokenizer")
    make_tiny_char_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tokenizer


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_the_marker_ids_come_from_the_vocabulary(think_tokenizer, name):
    parser = get_reasoning_parser(name)(think_tokenizer)
    assert parser.end_token_id == think_tokenizer.convert_tokens_to_ids("</think>")
    assert parser.start_token_id == think_tokenizer.convert_tokens_to_ids("<think>")
    ids = think_tokenizer.encode("a b</think>c", add_special_tokens=False)
    assert ids.count(parser.end_token_id) == 1 and len(ids) == 5


def test_a_tokenizers_tokenizer_works_too(think_tokenizer):
    raw = think_tokenizer.backend_tokenizer  # a tokenizers.Tokenizer: token_to_id, no get_vocab
    assert get_reasoning_parser("qwen3")(raw).end_token_id == think_tokenizer.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=f"{c['parser']}-{c['name']}") for c in CASES if "\n" not in c["output"]]
)
def test_token_by_token_detokenized_pieces(think_tokenizer, case):
    """As a server streams: one decoded token at a time, the markers kept (special tokens)."""
    ids = think_tokenizer.encode(case["output"], add_special_tokens=False)
    parts = [think_tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(parts) == case["output"]
    parser = get_reasoning_parser(case["parser"])(think_tokenizer).for_request(case.get("chat_template_kwargs"))
    assert streamed(parser, parts) == (case["reasoning"] or "", case["content"] or "")
