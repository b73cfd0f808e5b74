"""Image and chat-style inputs over HTTP, on the fake backend (``fake?image_tokens=8``: a
model that takes images, whose image vectors are a function of the pixels): vLLM's
``messages`` on /v1/embeddings (through the official openai client too), Cohere's
``images`` and ``inputs`` on /v2/embed, images on /score and /rerank, and the refusals a
client would meet, each a 400 naming its field.

The images are real base64 PNG data URIs made with Pillow.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from embedding_server.device.fake import FAKE_CHAT_TEMPLATE
from embedding_server.request.media import fetching as media
from embedding_server.request.media.inputs import ChatTemplate, parse_messages
from openai.types import CreateEmbeddingResponse

from tests.support.api import RunningServer, fake_settings, running_server
from tests.support.images import data_uri, picture

pytestmark = pytest.mark.timeout(120)

IMAGE_TOKENS = 8
RED, BLUE, NOISE = data_uri(picture(1)), data_uri(picture(2)), data_uri(picture(3))


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A fake model that takes images (a dual encoder: no chat template)."""
    settings = fake_settings(f"fake?dim=32&image_tokens={IMAGE_TOKENS}", max_images_per_request=3)
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def text_server() -> Iterator[RunningServer]:
    """A text-only fake model with a chat template (an instruction-tuned decoder's shape)."""
    with running_server(fake_settings("fake?dim=32&chat=true&prompts=false")) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any], status: int = 200) -> Any:
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    return response.json()


def refused(server: RunningServer, path: str, body: dict[str, Any], param: str) -> str:
    """The 400's message, after checking it is OpenAI-shaped and names ``param``."""
    error = post(server, path, body, 400)["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error", error
    return str(error["message"])


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def embed_messages(server: RunningServer, content: Any, **extra: Any) -> np.ndarray:
    body = {"messages": [{"role": "user", "content": content}], **extra}
    data = post(server, "/v1/embeddings", body)["data"]
    assert len(data) == 1
    return np.array(data[0]["embedding"], np.float32)


def embed_inputs(server: RunningServer, inputs: list[str], **extra: Any) -> np.ndarray:
    data = post(server, "/v1/embeddings", {"input": inputs, **extra})["data"]
    return np.array([d["embedding"] for d in data], np.float32)


def cohere_images(server: RunningServer, images: list[str]) -> np.ndarray:
    body = post(server, "/v2/embed", {"images": images, "input_type": "image"})
    return np.array(body["embeddings"]["float"], np.float32)


# -- /v1/embeddings: messages ----------------------------------------------------------------


def test_an_image_message_is_embedded_by_its_pixels(server: RunningServer) -> None:
    red = embed_messages(server, [image_part(RED)])
    again = embed_messages(server, [image_part(RED)])
    blue = embed_messages(server, [image_part(BLUE)])
    np.testing.assert_array_equal(red, again)
    assert float(red @ blue) < 0.999  # another image, another vector
    np.testing.assert_allclose(np.linalg.norm(red), 1.0, atol=1e-5)
    # The same image through Cohere's images field is the same vector.
    np.testing.assert_allclose(cohere_images(server, [RED, BLUE]), [red, blue], atol=1e-6)


def test_usage_counts_an_image_by_its_tokens(server: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": [image_part(RED)]}]}
    usage = post(server, "/v1/embeddings", body)["usage"]
    assert usage["prompt_tokens"] == IMAGE_TOKENS


def test_a_text_message_on_a_dual_encoder_is_its_text_embedded(server: RunningServer) -> None:
    text = "a photo of a red square"
    as_string = embed_messages(server, text)
    as_part = embed_messages(server, [{"type": "text", "text": text}])
    np.testing.assert_allclose(as_string, embed_inputs(server, [text])[0], atol=1e-6)
    np.testing.assert_allclose(as_part, as_string, atol=1e-6)


def test_dimensions_apply_to_an_image(server: RunningServer) -> None:
    full = embed_messages(server, [image_part(RED)])
    short = embed_messages(server, [image_part(RED)], dimensions=8)
    assert short.shape == (8,)
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-5)


def test_a_dual_encoder_refuses_messages_that_do_not_make_one_input(
    server: RunningServer,
) -> None:
    two_images = [image_part(RED), image_part(BLUE)]
    message = refused(
        server,
        "/v1/embeddings",
        {"messages": [{"role": "user", "content": two_images}]},
        "messages",
    )
    assert "one text or one image" in message
    mixed = [{"type": "text", "text": "a cat"}, image_part(RED)]
    refused(
        server, "/v1/embeddings", {"messages": [{"role": "user", "content": mixed}]}, "messages"
    )
    # A chat template option means nothing without a template: refused, not ignored.
    body = {
        "messages": [{"role": "user", "content": "a cat"}],
        "add_generation_prompt": True,
    }
    refused(server, "/v1/embeddings", body, "add_generation_prompt")


def test_input_and_messages_are_exclusive(server: RunningServer) -> None:
    both = {"input": "a", "messages": [{"role": "user", "content": "a"}]}
    refused(server, "/v1/embeddings", both, "messages")
    refused(server, "/v1/embeddings", {"model": "fake"}, "input")
    # Chat fields with input would be ignored: refused instead.
    refused(
        server,
        "/v1/embeddings",
        {"input": "a", "continue_final_message": True},
        "continue_final_message",
    )


def test_fields_that_are_not_served_are_refused(server: RunningServer) -> None:
    messages = [{"role": "user", "content": [image_part(RED)]}]
    for name, value in (
        ("chat_template", "{{ messages }}"),
        ("mm_processor_kwargs", {"size": 10}),
        ("media_io_kwargs", {"image": {}}),
    ):
        refused(server, "/v1/embeddings", {"messages": messages, name: value}, name)
    bad_part = [{"type": "input_audio", "input_audio": {}}]
    refused(
        server,
        "/v1/embeddings",
        {"messages": [{"role": "user", "content": bad_part}]},
        "messages[0].content[0]",
    )


def test_a_prompt_for_images_alone_is_refused(server: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": [image_part(RED)]}], "prompt_name": "query"}
    refused(server, "/v1/embeddings", body, "prompt_name")
    # input_type only picks a text prompt where there is one: an image embeds as it is.
    typed = embed_messages(server, [image_part(RED)], input_type="search_query")
    np.testing.assert_allclose(typed, embed_messages(server, [image_part(RED)]), atol=1e-6)


def test_too_many_images_are_refused_before_any_is_fetched(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched: list[str] = []
    fetch = media.fetch_image

    async def counting(url: str, policy: media.MediaPolicy, *, param: str) -> bytes:
        fetched.append(param)
        return await fetch(url, policy, param=param)

    monkeypatch.setattr(media, "fetch_image", counting)
    message = refused(server, "/v2/embed", {"images": [RED] * 4, "input_type": "image"}, "images")
    assert "max_images_per_request" in message
    assert fetched == []


def test_models_and_info_list_the_modalities(
    server: RunningServer, text_server: RunningServer
) -> None:
    models = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert models["modalities"] == ["text", "image"]
    info = httpx.get(server.url + "/info").json()
    assert info["modalities"] == ["text", "image"]
    assert info["image_tokens"] == IMAGE_TOKENS
    assert httpx.get(text_server.url + "/v1/models").json()["data"][0]["modalities"] == ["text"]


def test_the_openai_client_sends_messages(server: RunningServer) -> None:
    """Both ways the README and the API page show: ``embeddings.create`` with ``input=omit``
    and the messages in ``extra_body``, and vLLM's documented ``post``."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    created = client.embeddings.create(
        model="fake",
        input=openai.omit,
        extra_body={"messages": [{"role": "user", "content": [image_part(RED)]}]},
    )
    np.testing.assert_allclose(
        np.array(created.data[0].embedding, np.float32),
        embed_messages(server, [image_part(RED)]),
        atol=1e-6,
    )
    response = client.post(
        "/embeddings",
        cast_to=CreateEmbeddingResponse,
        body={"model": "fake", "messages": [{"role": "user", "content": [image_part(RED)]}]},
    )
    got = np.array(response.data[0].embedding, np.float32)
    np.testing.assert_allclose(got, embed_messages(server, [image_part(RED)]), atol=1e-6)
    assert response.usage.prompt_tokens == IMAGE_TOKENS
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(
            "/embeddings",
            cast_to=CreateEmbeddingResponse,
            body={"messages": [{"role": "user", "content": [image_part(RED)] * 2}]},
        )
    assert caught.value.body["param"] == "messages"  # type: ignore[index]


# -- text models: chat templates, and images refused -----------------------------------------


def test_a_chat_template_renders_the_messages(text_server: RunningServer) -> None:
    """The conversation is rendered through the template (as transformers does) and
    tokenized without special tokens added again (vLLM's default)."""
    messages = [
        {"role": "system", "content": "Represent the query."},
        {"role": "user", "content": [{"type": "text", "text": "red squares"}]},
    ]
    rendered = ChatTemplate(FAKE_CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}).render(
        parse_messages(messages), add_generation_prompt=True
    )
    assert rendered.startswith("<s><|system|>\nRepresent the query.</s>\n<|user|>\nred squares")
    got = post(text_server, "/v1/embeddings", {"messages": messages, "add_generation_prompt": True})
    want = post(text_server, "/v1/embeddings", {"input": rendered, "add_special_tokens": False})
    np.testing.assert_allclose(got["data"][0]["embedding"], want["data"][0]["embedding"], atol=1e-6)
    plain = post(text_server, "/tokenize", {"prompt": rendered, "add_special_tokens": False})
    assert got["usage"]["prompt_tokens"] == plain["count"]
    # add_special_tokens, when asked, adds them on top of the template's.
    special = post(
        text_server,
        "/v1/embeddings",
        {"messages": messages, "add_generation_prompt": True, "add_special_tokens": True},
    )
    assert special["usage"]["prompt_tokens"] == plain["count"] + 2


def test_a_template_that_refuses_a_role_is_a_400(text_server: RunningServer) -> None:
    body = {"messages": [{"role": "tool", "content": "x"}]}
    assert "unknown role" in refused(text_server, "/v1/embeddings", body, "messages")


def test_a_text_model_refuses_an_image_naming_the_part(text_server: RunningServer) -> None:
    content = [{"type": "text", "text": "a cat"}, image_part(RED)]
    body = {"messages": [{"role": "user", "content": content}]}
    message = refused(text_server, "/v1/embeddings", body, "messages[0].content[1]")
    assert "text only" in message
    refused(text_server, "/v2/embed", {"images": [RED], "input_type": "image"}, "images[0]")
    inputs = {
        "inputs": [{"content": [{"type": "text", "text": "a"}]}, {"content": [image_part(RED)]}]
    }
    refused(text_server, "/v2/embed", inputs, "inputs[1].content[0]")
    score = {"text_1": "a cat", "text_2": {"content": [image_part(RED)]}}
    refused(text_server, "/score", score, "text_2.content[0]")


def test_a_text_model_without_a_chat_template_refuses_messages() -> None:
    with running_server(fake_settings("fake?dim=16")) as plain:
        body = {"messages": [{"role": "user", "content": "hello"}]}
        assert "chat template" in refused(plain, "/v1/embeddings", body, "messages")


# -- Cohere /v2/embed -------------------------------------------------------------------------


def test_cohere_inputs_are_one_embedding_each(server: RunningServer) -> None:
    inputs = [
        {"content": [{"type": "text", "text": "a red square"}]},
        {"content": [{"type": "image_url", "image_url": RED}]},  # Cohere's string form
    ]
    body = post(server, "/v2/embed", {"inputs": inputs, "input_type": "search_document"})
    got = np.array(body["embeddings"]["float"], np.float32)
    assert got.shape == (2, 32)
    # The text gets the model's document prompt, as texts do; the image none.
    document = embed_inputs(server, ["a red square"], input_type="search_document")[0]
    np.testing.assert_allclose(got[0], document, atol=1e-6)
    np.testing.assert_allclose(got[1], cohere_images(server, [RED])[0], atol=1e-6)
    assert body["meta"]["billed_units"]["input_tokens"] > IMAGE_TOKENS
    types = post(server, "/v2/embed", {"images": [RED], "embedding_types": ["float", "int8"]})
    assert set(types["embeddings"]) == {"float", "int8"}


def test_cohere_refuses_what_it_cannot_serve(server: RunningServer) -> None:
    # Images beside texts were silently ignored once: now a 400.
    refused(server, "/v2/embed", {"texts": ["a"], "images": [RED]}, "images")
    refused(server, "/v2/embed", {"input_type": "search_query"}, "texts")
    refused(server, "/v2/embed", {"texts": ["a"], "input_type": "image"}, "input_type")
    # Embed v4 clients send images with a text input_type: it selects no prompt for them.
    typed = post(server, "/v2/embed", {"images": [RED], "input_type": "search_document"})
    np.testing.assert_allclose(
        typed["embeddings"]["float"], cohere_images(server, [RED]), atol=1e-6
    )
    two_parts = {"inputs": [{"content": [{"type": "text", "text": "a"}, image_part(RED)]}]}
    assert "one text or one image" in refused(server, "/v2/embed", two_parts, "inputs[0].content")
    sparse = {"images": [RED], "embedding_types": ["sparse"]}
    refused(server, "/v2/embed", sparse, "embedding_types")


# -- /score and /rerank across modalities -----------------------------------------------------


def test_score_a_text_against_images_by_cosine(server: RunningServer) -> None:
    query = "a red square"
    images = [RED, BLUE, NOISE]
    body = {"text_1": query, "text_2": {"content": [image_part(u) for u in images]}}
    scores = [d["score"] for d in post(server, "/score", body)["data"]]
    text = embed_inputs(server, [query])[0]
    want = cohere_images(server, images) @ text
    np.testing.assert_allclose(scores, want, atol=1e-5)
    both_images = {
        "text_1": {"content": [image_part(RED)]},
        "text_2": {"content": [image_part(RED)]},
    }
    assert post(server, "/score", both_images)["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)


def test_rerank_images_for_a_text_query(server: RunningServer) -> None:
    images = [RED, BLUE, NOISE]
    body = {
        "query": "a red square",
        "documents": {"content": [image_part(u) for u in images]},
        "top_n": 2,
    }
    got = post(server, "/rerank", body)
    text = embed_inputs(server, ["a red square"])[0]
    cosines = cohere_images(server, images) @ text
    order = list(np.argsort(-cosines)[:2])
    assert [r["index"] for r in got["results"]] == order
    np.testing.assert_allclose(
        [r["relevance_score"] for r in got["results"]], cosines[order], atol=1e-5
    )
    assert got["results"][0]["document"] == {"image_url": {"url": images[order[0]]}}
    assert got["usage"]["prompt_tokens"] > 3 * IMAGE_TOKENS
    # An image query against text documents.
    image_query = {"query": {"content": [image_part(RED)]}, "documents": ["a", "b"]}
    assert len(post(server, "/rerank", image_query)["results"]) == 2
    two = {"query": {"content": [image_part(RED), image_part(BLUE)]}, "documents": ["a"]}
    refused(server, "/rerank", two, "query")


def test_a_lone_surrogate_in_a_content_part_is_a_400(text_server: RunningServer) -> None:
    raw = '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}'
    response = httpx.post(
        text_server.url + "/v1/embeddings",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content[0]"


def test_no_prompt_goes_before_a_rendered_conversation() -> None:
    """The template formats the text: an explicit prompt_name is refused, and input_type
    (a hint) selects no prompt for it."""
    with running_server(fake_settings("fake?dim=16&chat=true")) as chat:
        messages = [{"role": "user", "content": "red squares"}]
        body = {"messages": messages, "prompt_name": "query"}
        assert "chat template" in refused(chat, "/v1/embeddings", body, "prompt_name")
        plain = post(chat, "/v1/embeddings", {"messages": messages})["data"][0]["embedding"]
        typed = post(chat, "/v1/embeddings", {"messages": messages, "input_type": "search_query"})
        np.testing.assert_allclose(typed["data"][0]["embedding"], plain, atol=1e-6)
