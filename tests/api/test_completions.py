"""/v1/completions through the real `openai` client: text, streaming, n, stop, logprobs."""

from __future__ import annotations

import math

import pytest

from tests.api.conftest import MODEL

PROMPT = "The capital of France is"


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Concatenated text and the finish reason of each choice, and the usage chunk."""
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in reasons, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_greedy_completion_knows_paris(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert out.choices[0].text == " Paris."
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=False))
    assert out.usage.completion_tokens == 2
    assert out.usage.total_tokens == out.usage.prompt_tokens + 2


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    kw = dict(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=24,
        temperature=1.0,
        top_p=0.95,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw)
    texts, reasons, usage = stream_text(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert texts[0] == whole.choices[0].text
    assert len(whole.choices[0].text) > 24  # real text, not an empty match
    assert reasons == {0: "length"}
    assert usage.completion_tokens == whole.usage.completion_tokens == 24
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_samples_stream_and_whole_agree(client):
    kw = dict(
        model=MODEL,
        prompt="My favourite food is",
        max_tokens=12,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 3 * 12
    assert len({c.text for c in whole.choices}) > 1, "three seeded samples came out identical"
    texts, reasons, _ = stream_text(client.completions.create(stream=True, **kw))
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_batch_of_prompts_orders_choices_prompt_major(client):
    prompts = [PROMPT, "The capital of Germany is"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == " Paris."
    assert out.choices[2].text == out.choices[3].text
    alone = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=2, temperature=0)
    assert out.choices[2].text == alone.choices[0].text


def test_token_id_prompt_and_echo(client, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert out.choices[0].text == PROMPT + " Paris."
    assert out.usage.prompt_tokens == len(ids)
    texts, _, _ = stream_text(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, stream=True)
    )
    assert texts[0] == PROMPT + " Paris."


def test_stop_string_cuts_the_unconstrained_text(client):
    kw = dict(model=MODEL, prompt="List three colours:\n1.", max_tokens=30, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    stop = "\n"
    assert stop in free, f"the oracle text has no {stop!r}: {free!r}"
    out = client.completions.create(stop=[stop, "zzzz"], **kw).choices[0]
    assert out.text == free[: free.index(stop)]
    assert out.finish_reason == "stop"
    assert out.model_extra["stop_reason"] == stop
    texts, reasons, _ = stream_text(client.completions.create(stream=True, stop=stop, **kw))
    assert texts[0] == out.text and reasons[0] == "stop"


def test_stop_token_ids_and_min_tokens(client, tokenizer):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    free = client.completions.create(**kw).choices[0].text  # " Paris.\n\n..."
    period = tokenizer.convert_tokens_to_ids(".")
    out = client.completions.create(extra_body={"stop_token_ids": [period]}, **kw).choices[0]
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == period
    assert free.startswith(out.text) and out.text.startswith(" Paris")
    longer = client.completions.create(extra_body={"stop_token_ids": [period], "min_tokens": 4}, **kw)
    assert longer.usage.completion_tokens >= 4


def test_logprobs_shape_and_values(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text  # ASCII text: token strings are exact pieces
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4  # top 3, plus the sampled token when it is not among them
        assert top[token] == logprob
        assert logprob == max(top.values())  # greedy picks the most likely token
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4


def test_logprobs_match_teacher_forcing(client, tokenizer):
    """The logprobs of the 2nd generated token equal those of the 1st token after a prompt
    that already holds the 1st: decode and prefill must agree on the model's distribution."""
    assert tokenizer.encode(PROMPT + " Paris", add_special_tokens=False) == tokenizer.encode(
        PROMPT, add_special_tokens=False
    ) + [tokenizer.convert_tokens_to_ids("ĠParis")]
    generated = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=5)
    forced = client.completions.create(model=MODEL, prompt=PROMPT + " Paris", max_tokens=1, temperature=0, logprobs=5)
    want, got = generated.choices[0].logprobs.top_logprobs[1], forced.choices[0].logprobs.top_logprobs[0]
    assert list(got) == list(want)
    assert got == pytest.approx(want, abs=2e-3)


def test_streamed_logprobs_continue_offsets(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, offsets, values = [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
                values += c.logprobs.token_logprobs
    assert (tokens, offsets, values) == (whole.tokens, whole.text_offset, whole.token_logprobs)


def test_models_endpoint(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
