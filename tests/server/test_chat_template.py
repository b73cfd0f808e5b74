"""Chat templates render as transformers' ``apply_chat_template(..., tokenize=False)`` renders
them (the reference: the same messages through a transformers tokenizer carrying the same
template), and are found where transformers finds them in a model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from embedding_server.device.fake import FAKE_CHAT_TEMPLATE, build_fake_tokenizer
from embedding_server.errors import InvalidRequestError
from embedding_server.request.media.inputs import ChatTemplate, parse_messages
from transformers import PreTrainedTokenizerFast

# A Qwen-style template: namespace, loop controls, tojson, a system default.
QWEN_STYLE = (
    "{%- set ns = namespace(system=false) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}{%- set ns.system = true -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if not ns.system -%}<|im_start|>system\nYou are helpful.<|im_end|>\n{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.content is string -%}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- else -%}<|im_start|>{{ message.role }}\n"
    "{%- for part in message.content -%}{%- if part.type != 'text' -%}{%- continue -%}"
    "{%- endif -%}{{ part.text }}{%- endfor -%}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if meta is defined -%}{{ meta | tojson }}{%- endif -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

# SmolLM-style: the assistant's turns inside {% generation %} (training masks).
GENERATION_BLOCKS = (
    "{% for message in messages %}<|{{ message.role }}|>"
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content }}"
    "{% endgeneration %}{% else %}{{ message.content }}{% endif %}\n{% endfor %}"
)

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is a café?"}],
    [
        {"role": "system", "content": "Represent the query for retrieval."},
        {"role": "user", "content": [{"type": "text", "text": "red <b>squares</b>"}]},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I"},
    ],
]


def reference(template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=build_fake_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        chat_template=template,
    )


@pytest.mark.parametrize(
    "template",
    [FAKE_CHAT_TEMPLATE, QWEN_STYLE, GENERATION_BLOCKS],
    ids=["zephyr", "qwen", "generation-blocks"],
)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("mode", ["plain", "generation", "continue"])
def test_rendering_matches_transformers(template: str, conversation: int, mode: str) -> None:
    messages = CONVERSATIONS[conversation]
    options = {
        "add_generation_prompt": mode == "generation",
        "continue_final_message": mode == "continue",
    }
    want = reference(template).apply_chat_template(
        messages, tokenize=False, meta={"k": "é<"}, **options
    )
    ours = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>"})
    got = ours.render(parse_messages(messages), kwargs={"meta": {"k": "é<"}}, **options)
    assert got == want


def test_the_template_is_found_in_the_model_directory(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "default", "template": FAKE_CHAT_TEMPLATE},
            {"name": "tool_use", "template": "x"},
        ],
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    found = ChatTemplate.from_directory(tmp_path)
    assert found is not None
    assert found.source == FAKE_CHAT_TEMPLATE
    assert found.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    # chat_template.jinja, where transformers now writes it, comes first.
    (tmp_path / "chat_template.jinja").write_text(QWEN_STYLE)
    jinja = ChatTemplate.from_directory(tmp_path)
    assert jinja is not None and jinja.source == QWEN_STYLE
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_directory(empty) is None


def test_the_sandbox_refuses_reaching_into_python() -> None:
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        escape.render(parse_messages([{"role": "user", "content": "x"}]))


def test_generation_prompt_and_continue_exclude_each_other() -> None:
    ours = ChatTemplate(FAKE_CHAT_TEMPLATE)
    with pytest.raises(InvalidRequestError) as caught:
        ours.render(
            parse_messages(CONVERSATIONS[0]),
            add_generation_prompt=True,
            continue_final_message=True,
        )
    assert caught.value.param == "continue_final_message"


def test_messages_on_a_decoder_embedder_are_transformers_chat_tokens(
    tiny_model: Any, tmp_path: Path
) -> None:
    """A tiny Qwen3 embedder with a chat template: a ``messages`` request embeds exactly the
    token ids transformers' ``apply_chat_template(..., tokenize=True)`` gives (no special
    tokens added again), as the same ids sent as ``input`` are embedded."""
    import shutil

    import httpx
    import numpy as np
    from embedding_server.settings import ServerSettings
    from transformers import AutoTokenizer

    from tests.support.api import running_server

    model = tmp_path / "qwen3-chat"
    shutil.copytree(tiny_model("qwen3"), model)
    hf = AutoTokenizer.from_pretrained(str(model))
    hf.chat_template = QWEN_STYLE
    hf.save_pretrained(str(model))
    messages = CONVERSATIONS[1]
    encoded = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    with running_server(ServerSettings(model=str(model), dtype="float32")) as server:
        url = server.url + "/v1/embeddings"
        chat = httpx.post(url, json={"messages": messages, "add_generation_prompt": True})
        assert chat.status_code == 200, chat.text
        plain = httpx.post(url, json={"input": ids})
        assert plain.status_code == 200, plain.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(
        chat.json()["data"][0]["embedding"], plain.json()["data"][0]["embedding"], atol=1e-6
    )


# -- a request's chat-template inputs are bounded before they cost rendering ---------------

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize(
    "name",
    [
        "eos_token",  # the tokenizer's, written after every message
        "bos_token",
        "pad_token",  # a special token the tokenizer does not set: still the tokenizer's name
        "raise_exception",  # the template's own refusal
        "strftime_now",
        "namespace",
        "messages",
        "add_generation_prompt",  # a request field of its own
    ],
)
def test_request_kwargs_cannot_set_what_the_renderer_supplies(name: str) -> None:
    """A special token set by the request, written after each of N messages, rendered N
    times its length before any check (issue H1); shadowing ``raise_exception`` turned the
    template's 400 into a 500 (M1)."""
    template = ChatTemplate(FAKE_CHAT_TEMPLATE, SPECIALS)
    with pytest.raises(InvalidRequestError) as caught:
        template.render(parse_messages(CONVERSATIONS[0]), kwargs={name: "A" * 1000})
    assert caught.value.param == f"chat_template_kwargs.{name}"
    assert "cannot be set by a request" in str(caught.value)


def test_other_kwargs_still_reach_the_template() -> None:
    template = ChatTemplate(QWEN_STYLE, SPECIALS)
    got = template.render(parse_messages(CONVERSATIONS[0]), kwargs={"meta": {"k": 1}})
    assert got.endswith('{"k": 1}')


def test_a_conversation_rendering_past_the_limit_is_refused_as_it_is_written() -> None:
    """A kwarg the template writes per message: 2000 x 10,000 characters would be 20 M
    characters; the limit (twice max_request_bytes) refuses it as the template writes,
    holding about the limit, never the whole text."""
    import tracemalloc

    template = ChatTemplate("{% for m in messages %}{{ sep }}{{ m.content }}{% endfor %}")
    messages = parse_messages([{"role": "user", "content": "x"}] * 2000)
    kwargs = {"sep": "A" * 10_000}
    # Within the limit the same conversation renders whole.
    assert len(template.render(messages, kwargs=kwargs, max_request_bytes=20_000_000)) == (
        2000 * 10_001
    )
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequestError) as caught:
            template.render(messages, kwargs=kwargs, max_request_bytes=1_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.param == "messages"
    assert "2,000,000 characters" in str(caught.value)
    assert peak < 8 * 2**20, f"rendering held {peak / 2**20:.0f} MiB before it was refused"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{% for m in messages %}{{ m.name + '!' }}{% endfor %}", {"name": 5}),
        ("{% for m in messages %}{{ m.content | int // m.n }}{% endfor %}", {"n": 0}),
        ("{% for m in messages %}{{ m.content.split(m.sep) }}{% endfor %}", {"sep": ""}),
    ],
    ids=["type-error", "zero-division", "value-error"],
)
def test_a_template_failing_on_the_request_data_is_a_400(
    source: str, message: dict[str, Any]
) -> None:
    """The template is the model's and compiled at load, so what fails while it renders is
    the request's data (a message's extra field of another type, ...): a 400, not a 500."""
    template = ChatTemplate(source)
    messages = parse_messages([{"role": "user", "content": "7", **message}])
    with pytest.raises(InvalidRequestError) as caught:
        template.render(messages)
    assert caught.value.param == "messages"
    assert "chat template" in str(caught.value)


def test_more_messages_than_allowed_are_refused_before_each_is_parsed() -> None:
    from embedding_server.request.media.inputs import MAX_CHAT_MESSAGES

    # Not messages at all past the first: counted, never looked at.
    flood: list[Any] = [{"role": "user", "content": "x"}] + [None] * MAX_CHAT_MESSAGES
    with pytest.raises(InvalidRequestError) as caught:
        parse_messages(flood)
    assert caught.value.param == "messages"
    assert f"at most {MAX_CHAT_MESSAGES}" in str(caught.value)
    assert len(parse_messages([{"role": "user", "content": "x"}] * MAX_CHAT_MESSAGES)) == (
        MAX_CHAT_MESSAGES
    )
