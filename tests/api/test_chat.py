"""/v1/chat/completions: the model's chat template, streaming chunks, chat logprobs."""

from __future__ import annotations

from tests.api.conftest import MODEL

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_chat_applies_the_template(client, tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    message = out.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    # Oracle: transformers renders the same template; the chat reply equals a plain
    # completion of that rendered prompt.
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    plain = client.completions.create(model=MODEL, prompt=rendered, max_tokens=12, temperature=0)
    assert message.content == plain.choices[0].text
    assert out.choices[0].finish_reason == plain.choices[0].finish_reason


def test_chat_stops_at_end_of_turn(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say just: OK"}], temperature=0
    )  # no max_tokens: the rest of the context
    assert out.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in out.choices[0].message.content
    assert out.usage.completion_tokens < 200


def test_streamed_chat_equals_non_streamed(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a haiku about rain."}],
        temperature=0.8,
        seed=99,
        max_completion_tokens=30,
        n=2,
    )
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    texts, roles, reasons, usage = {}, {}, {}, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for item in content:
        assert bytes(item.bytes).decode("utf-8") == item.token
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    no_top = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True)
    assert [t.top_logprobs for t in no_top.choices[0].logprobs.content] == [[], []]
    assert [t.logprob for t in no_top.choices[0].logprobs.content] == [t.logprob for t in content[:2]]


def test_multibyte_text_streams_whole_characters(client):
    """Characters split across tokens never reach the client as U+FFFD, and each token's
    `bytes` are its exact UTF-8 bytes even when it holds only part of a character."""
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Écris « bonjour » et un emoji 😀 en chinois: 你好"}],
        max_tokens=40,
        temperature=0.7,
        seed=3,
        logprobs=True,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    text = whole.message.content
    assert any(ord(ch) > 0xFFFF for ch in text), f"the oracle needs 4-byte characters (emoji): {text!r}"
    assert "\ufffd" not in text
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == text
    tokens = whole.logprobs.content[:-1] if whole.finish_reason == "stop" else whole.logprobs.content  # not eos
    raw = b"".join(bytes(t.bytes) for t in tokens)
    assert raw.decode("utf-8", errors="ignore") == text  # only a trailing partial character may be cut
    partial = [t for t in tokens if not _is_utf8(bytes(t.bytes))]
    assert partial and all("\\x" in t.token for t in partial)  # escaped, not U+FFFD


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
