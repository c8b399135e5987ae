"""logit_bias (OpenAI's), allowed_token_ids and bad_words (vLLM's, through `extra_body`) on
the session server with the real `openai` client.

Oracles: transformers' tokenizer for the default model (the token a bias forces, what the
allowed ids spell), and the same request without the field.
"""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import MODEL

PROMPT = "The capital of France is"


def complete(client, **kw) -> str:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, **kw).choices[0].text


def test_logit_bias_forces_a_token_in_completions_and_chat(client, tokenizer):
    (x,) = tokenizer.encode(" banana", add_special_tokens=False)
    assert complete(client, logit_bias={str(x): 100}) == tokenizer.decode([x] * 8)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logit_bias={str(x): 100}
    )
    assert chat.choices[0].message.content == tokenizer.decode([x] * 4)


def test_allowed_token_ids_and_bad_words(client, tokenizer):
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "01"]
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1, extra_body={"allowed_token_ids": digits}
    ).choices[0]
    assert len(out.text) == 10 and set(out.text) <= {"0", "1"}  # eos is not allowed either: full length

    free = complete(client)
    word = free.split()[0].strip(".,")
    assert tokenizer.encode(" " + word, add_special_tokens=False)[-1] in tokenizer.encode(
        free, add_special_tokens=False
    )
    banned = complete(client, extra_body={"bad_words": [word]})
    assert word not in banned and banned != free


@pytest.mark.parametrize(
    "body,param",
    [
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # past the vocabulary
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
        ({"extra_body": {"allowed_token_ids": [49152]}}, "allowed_token_ids"),
        ({"extra_body": {"bad_words": [" "]}}, "bad_words"),
    ],
)
def test_bad_values_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **body)
    assert caught.value.body["param"].startswith(param), caught.value.body
