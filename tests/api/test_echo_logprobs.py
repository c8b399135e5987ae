"""`echo` with `logprobs`, and vLLM's `prompt_logprobs`, through the real `openai` client.

Oracles: the prompt's own text and tokens (the default model's tokenizer), the same
request without echo (the generated part), and the `prompt_logprobs` the server reports
for the same prompt (the echoed part): two paths to the same numbers.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.conftest import MODEL

PROMPT = "The capital of France is a city on the river"
K = 3


@pytest.fixture(scope="module")
def answers(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(echo=True, logprobs=K, **kw)
    plain = client.completions.create(logprobs=K, **kw)
    reported = client.completions.create(extra_body={"prompt_logprobs": K}, **kw)
    return echoed, plain, reported


def test_echo_text_and_tokens(answers, tokenizer):
    echoed, plain, _ = answers
    prompt_ids = tokenizer.encode(PROMPT)
    p = len(prompt_ids)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert len(lp.tokens) == p + len(plain.choices[0].logprobs.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens[:p]) == PROMPT  # ASCII text: token strings are exact pieces
    assert lp.tokens[p:] == plain.choices[0].logprobs.tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echoed_logprobs_are_the_prompt_logprobs_then_the_generated_ones(answers, tokenizer):
    echoed, plain, reported = answers
    prompt_ids = tokenizer.encode(PROMPT)
    p = len(prompt_ids)
    lp, want = echoed.choices[0].logprobs, reported.choices[0].model_extra["prompt_logprobs"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert len(want) == p and want[0] is None
    for i in range(1, p):
        entry = want[i]
        assert lp.token_logprobs[i] == pytest.approx(entry[str(prompt_ids[i])]["logprob"], abs=1e-6)
        top = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] <= K)
        assert [r for r, _ in top] == list(range(1, K + 1))
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:K] == pytest.approx([v for _, v in top], abs=1e-6)
        assert 3 <= len(lp.top_logprobs[i]) <= 4  # top 3, plus the prompt token when it is not among them
        assert lp.tokens[i] in lp.top_logprobs[i]
    generated = plain.choices[0].logprobs
    assert lp.token_logprobs[p:] == pytest.approx(generated.token_logprobs, abs=1e-6)
    assert [list(t) for t in lp.top_logprobs[p:]] == [list(t) for t in generated.top_logprobs]
    assert reported.choices[0].text == plain.choices[0].text


def test_reported_prompt_logprobs_shape(answers, tokenizer):
    _, _, reported = answers
    prompt_ids = tokenizer.encode(PROMPT)
    for i, entry in enumerate(reported.choices[0].model_extra["prompt_logprobs"][1:], 1):
        assert str(prompt_ids[i]) in entry and len(entry) in (K, K + 1)
        mine = entry[str(prompt_ids[i])]
        assert mine["decoded_token"] == tokenizer.decode([prompt_ids[i]])
        more_likely = sum(v["logprob"] > mine["logprob"] for v in entry.values())
        if mine["rank"] <= K:  # among the top K, after the alternatives more likely than it
            assert mine["rank"] == 1 + more_likely and len(entry) == K
        else:  # after all K alternatives
            assert more_likely == K and len(entry) == K + 1


def test_streamed_echo_equals_whole(client, answers):
    whole = answers[0].choices[0].logprobs
    tokens, offsets, values, text = [], [], [], ""
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=K, stream=True
    ):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
                values += c.logprobs.token_logprobs
    assert text == answers[0].choices[0].text
    assert (tokens, offsets) == (whole.tokens, whole.text_offset)
    assert values[0] is None and values[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-6)


def test_echo_of_a_truncated_prompt_is_the_text_the_model_saw(client, tokenizer):
    """With truncate_prompt_tokens k, echo shows the last k prompt tokens' text, the same tokens
    the echoed logprobs cover, whole and streamed, for a text and a token-id prompt."""
    prompt_ids = tokenizer.encode(PROMPT)
    k = 4
    kept = tokenizer.decode(prompt_ids[-k:])
    assert len(prompt_ids) > k and kept != PROMPT
    kw = dict(model=MODEL, max_tokens=2, temperature=0, echo=True, logprobs=1, extra_body={"truncate_prompt_tokens": k})
    plain = client.completions.create(model=MODEL, prompt=prompt_ids[-k:], max_tokens=2, temperature=0)
    for prompt in (PROMPT, prompt_ids):
        choice = client.completions.create(prompt=prompt, **kw).choices[0]
        assert choice.text == kept + plain.choices[0].text
        assert "".join(choice.logprobs.tokens[:k]) == kept  # ASCII text: token strings are exact pieces
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == k + 2
        streamed = client.completions.create(prompt=prompt, stream=True, **kw)
        assert "".join(c.text for chunk in streamed for c in chunk.choices) == choice.text


def test_echo_without_logprobs(client, answers):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text == answers[0].choices[0].text
    assert out.choices[0].logprobs is None and out.choices[0].model_extra.get("prompt_logprobs") is None


def test_chat_prompt_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    reported = out.model_extra["prompt_logprobs"]
    assert len(reported) == out.usage.prompt_tokens and reported[0] is None
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in reported[1:])


@pytest.mark.parametrize("value", [-1, 21, 1.5, "2", True])
def test_bad_prompt_logprobs_is_400(server, value):
    for path, body in (
        ("completions", {"prompt": PROMPT}),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = httpx.post(
            f"{server.url}/v1/{path}",
            headers=server.headers,
            timeout=60,
            json={"model": MODEL, "max_tokens": 1, "prompt_logprobs": value, **body},
        )
        assert r.status_code == 400, (path, value, r.text)
        assert r.json()["error"]["param"] == "prompt_logprobs"


def test_openai_client_refusal_names_the_field(client):
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": -1})
