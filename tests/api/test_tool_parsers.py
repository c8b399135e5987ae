"""Tool-call parsers against model outputs and calls taken from vLLM's own parser tests
(tests/api/tool_parser_cases.json, each case naming its source), and the property that a
stream, however the text is split, adds up to the unstreamed reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.tool_parsers import (
    TOOL_PARSERS,
    ToolParser,
    get_tool_parser,
    load_tool_parser_plugin,
    parser_for_template,
)

CASES = json.loads((Path(__file__).parent / "tool_parser_cases.json").read_text())
CASE_IDS = [f"{c['parser']}-{i}" for i, c in enumerate(CASES)]
SPLITS = {"chars": 1, "chunks3": 3, "chunks7": 7, "whole": None}


def parser_of(case: dict) -> ToolParser:
    return get_tool_parser(case["parser"])(None)


def pieces(text: str, size: int | None) -> list[str]:
    return [text] if size is None else [text[i : i + size] for i in range(0, len(text), size)]


def arguments_value(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments.strip()  # mistral keeps malformed arguments as written


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_extract_matches_vllm(case):
    found = parser_of(case).extract(case["output"])
    assert found.content == case["content"]
    expected = case.get("raw_calls") or case["calls"]
    assert [c.name for c in found.tool_calls] == [c["name"] for c in expected]
    for call, want in zip(found.tool_calls, expected):
        if "arguments_text" in want:
            assert call.arguments == want["arguments_text"]
        else:
            assert json.loads(call.arguments) == want["arguments"]
            assert call.to_openai()["function"]["arguments"] == call.arguments


# The cases marked stream_differs (a call already sent when the output turns out malformed)
# are held to what they do instead by test_stream_differs_only_by_calls_already_sent.
STREAM_AGREES = [(c, i) for c, i in zip(CASES, CASE_IDS) if not c.get("stream_differs")]


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("case", [c for c, _ in STREAM_AGREES], ids=[i for _, i in STREAM_AGREES])
def test_stream_adds_up_to_extract(case, split):
    """Streamed content equals the unstreamed content (None read as ""; a content that is
    only whitespace is None unstreamed); the calls come in order with the same names, one
    id each, and their argument pieces join into the same JSON value."""
    parser = parser_of(case)
    whole = parser.extract(case["output"])
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces(case["output"], split)] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    if whole.content is None:
        assert content.strip() == ""
    else:
        assert content == whole.content
    names, ids, arguments = {}, {}, {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.name is not None:
                assert call.index not in names and call.index == len(names), "opened once, in order"
                names[call.index], ids[call.index] = call.name, call.id
                arguments[call.index] = ""
            else:
                assert call.id is None and call.index in names, "id and name on the first delta only"
            arguments[call.index] += call.arguments
    assert [names[i] for i in range(len(names))] == [c.name for c in whole.tool_calls]
    assert len(set(ids.values())) == len(ids) and all(ids.values())
    for i, call in enumerate(whole.tool_calls):
        assert arguments_value(arguments[i]) == arguments_value(call.arguments)
    assert stream.calls_seen == len(whole.tool_calls)


@pytest.mark.parametrize("case", [c for c in CASES if c.get("stream_differs")])
def test_documented_stream_differences_are_real(case):
    """Where streaming must differ, it differs only by calls it had sent before the output
    turned out not to hold calls; it never makes up content."""
    parser = parser_of(case)
    stream = parser.stream()
    deltas = [stream.feed(ch) for ch in case["output"]] + [stream.finish()]
    assert parser.extract(case["output"]).tool_calls == []
    assert stream.calls_seen > 0
    assert case["output"].startswith("".join(d.content for d in deltas))


def test_held_back_marker_then_not_a_marker():
    stream = get_tool_parser("hermes")(None).stream()
    assert stream.feed("a <tool").content == "a "
    assert stream.feed("box>").content == "<toolbox>"
    assert stream.finish().content == ""


def test_mistral_ids_are_nine_alphanumerics():
    parser = get_tool_parser("mistral")(None)
    assert parser.skip_special_tokens is False
    call = parser.extract('[TOOL_CALLS]add{"a": 1}').tool_calls[0]
    assert len(call.id) == 9 and call.id.isalnum()
    delta = parser.stream().feed('[TOOL_CALLS]add{"a"')
    assert len(delta.tool_calls[0].id) == 9


def test_openai_shapes():
    parser = get_tool_parser("hermes")(None)
    call = parser.extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls[0]
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
    opened, piece = parser.stream().feed('<tool_call>{"name": "f", "arguments": {"a"').tool_calls
    assert opened.to_openai() == {
        "index": 0,
        "id": opened.id,
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert piece.to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}


def test_unknown_parser_lists_the_known_names():
    with pytest.raises(ValueError) as error:
        get_tool_parser("nope")
    for name in ("hermes", "llama3_json", "mistral", "pythonic"):
        assert name in str(error.value)


def test_plugin_registers_a_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from api.tool_parsers import register_tool_parser\n"
        "from api.tool_parsers.base import Scan, ToolParser\n\n"
        "@register_tool_parser('shouty')\n"
        "class ShoutyParser(ToolParser):\n"
        "    def scan(self, text, final):\n"
        "        return Scan(len(text), [])\n"
    )
    try:
        load_tool_parser_plugin(str(plugin))
        parser = get_tool_parser("shouty")(None)
        assert parser.name == "shouty"
        assert parser.extract("HELLO").content == "HELLO"
    finally:
        TOOL_PARSERS.pop("shouty", None)
    with pytest.raises(ValueError):
        load_tool_parser_plugin(str(tmp_path / "missing.py"))


@pytest.mark.parametrize(
    "template, parser",
    [
        ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{...}\n</tool_call>", "hermes"),
        ("{%- if message.tool_calls %}[TOOL_CALLS][{{ message.tool_calls | tojson }}]{% endif %}", "mistral"),
        ("{%- if builtin_tools %}<|python_tag|>{% endif %}", "llama3_json"),
        ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
        ("{{ messages[0]['content'] }}", None),
        (None, None),
    ],
)
def test_parser_for_template(template, parser):
    assert parser_for_template(template) == parser


def test_parser_for_the_default_model_template():
    from jaxserve.weights.default_model import default_model_path
    from jaxserve.weights.gguf_reader import GGUFFile

    path = default_model_path()  # installed by .ci/run, as the README says
    template = GGUFFile(path).field("tokenizer.chat_template")
    assert "<|im_start|>" in template  # SmolLM2's template teaches no call format
    assert parser_for_template(template) is None


def test_a_plugin_that_writes_extract_alone_streams_its_calls_at_the_end(tmp_path):
    """vLLM's plugins write the unstreamed side first: such a parser still serves streams."""
    plugin = tmp_path / "call_line.py"
    plugin.write_text(
        "import json\n"
        "from api.tool_parsers import register_tool_parser\n"
        "from api.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser\n\n"
        "@register_tool_parser('call_line')\n"
        "class CallLine(ToolParser):\n"
        "    def extract(self, text):\n"
        "        head, _, call = text.partition('CALL ')\n"
        "        if not call:\n"
        "            return ExtractedToolCalls(text, [])\n"
        "        name, _, arguments = call.partition(' ')\n"
        "        return ExtractedToolCalls(head.strip() or None, [ToolCall(name, arguments)])\n"
    )
    text = 'Sure. CALL get_weather {"city": "Paris"}'
    try:
        load_tool_parser_plugin(str(plugin))
        parser = get_tool_parser("call_line")(None)
        stream = parser.stream()
        pieces = [stream.feed(text[i : i + 5]) for i in range(0, len(text), 5)]
        assert all(not p.content and not p.tool_calls for p in pieces)  # held back until the end
        last = stream.finish()
        whole = parser.extract(text)
        assert last.content == whole.content == "Sure."
        assert [(c.index, c.name) for c in last.tool_calls if c.name] == [(0, "get_weather")]
        assert json.loads("".join(c.arguments for c in last.tool_calls)) == {"city": "Paris"}
        assert stream.calls_seen == 1
    finally:
        TOOL_PARSERS.pop("call_line", None)
