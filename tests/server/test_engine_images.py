"""Images through the engine itself (the offline API and the scheduler), on the fake backend
(``fake?image_tokens=8``): PIL images and ImageInput mixed with texts come back in order, each
image's vector a function of its pixels, counted by its tokens in usage and admission;
prompts never apply to images, and a text-only model refuses them."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_server.device.fake_images import FakeImageProcessor
from embedding_server.engine import Engine
from embedding_server.errors import InvalidRequestError, TooManyTokensError

from tests.support.images import image_input, picture

pytestmark = pytest.mark.timeout(120)

TOKENS = 8


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(f"fake?dim=32&image_tokens={TOKENS}", dtype="float32")


def test_mixed_inputs_come_back_in_order(engine: Engine) -> None:
    red, blue = picture(1), picture(2)
    texts = ["a red square", "a blue one"]
    mixed = engine.embed_full([texts[0], red, texts[1], blue, red])
    alone = np.stack([engine.embed(x)[0] for x in (texts[0], red, texts[1], blue)])
    np.testing.assert_allclose(mixed.embeddings[:4], alone, atol=1e-6)
    np.testing.assert_array_equal(mixed.embeddings[4], mixed.embeddings[1])
    assert float(mixed.embeddings[1] @ mixed.embeddings[3]) < 0.999
    text_tokens = engine.embed_full(texts).prompt_tokens
    assert mixed.prompt_tokens == text_tokens + 3 * TOKENS
    assert mixed.token_counts[1] == TOKENS
    assert mixed.truncated_inputs == 0


def test_an_image_input_is_taken_as_it_is(engine: Engine) -> None:
    """An ImageInput is already preprocessed: its pixels are the model's input as given."""
    red = picture(1)
    processor = FakeImageProcessor(TOKENS)
    np.testing.assert_allclose(
        engine.embed(processor.preprocess(red)), engine.embed(red), atol=1e-6
    )
    # Other pixels, another vector: the pixels decide, not the placeholder ids.
    other = image_input(red, TOKENS, size=12)
    assert float(engine.embed(other)[0] @ engine.embed(red)[0]) < 0.999


def test_dimensions_and_normalize_apply_to_images(engine: Engine) -> None:
    red = picture(1)
    full = engine.embed(red, normalize=False)[0]
    short = engine.embed(red, dimensions=8)[0]
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-5)
    assert abs(float(np.linalg.norm(full)) - 1.0) > 1e-3  # not normalized when asked not to


def test_prompts_never_apply_to_images(engine: Engine) -> None:
    red = picture(1)
    with pytest.raises(InvalidRequestError) as caught:
        engine.embed([red], prompt_name="query")
    assert caught.value.param == "prompt_name"
    with pytest.raises(InvalidRequestError):
        engine.embed([red], prompt="Represent: ")
    # Beside a text, the prompt is the text's; the image is embedded as it is.
    mixed = engine.embed(["x", red], prompt_name="query")
    np.testing.assert_allclose(mixed[0], engine.embed("x", prompt_name="query")[0], atol=1e-6)
    np.testing.assert_allclose(mixed[1], engine.embed(red)[0], atol=1e-6)


def test_per_token_outputs_refuse_images(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError):
        engine.embed_tokens([picture(1)])  # type: ignore[list-item]


def test_rerank_and_score_across_modalities(engine: Engine) -> None:
    images = [picture(1), picture(2), picture(3)]
    ranked = engine.rerank("a red square", images)
    text = engine.embed("a red square")[0]
    cosines = engine.embed(images) @ text
    assert [r.index for r in ranked.results] == list(np.argsort(-cosines))
    np.testing.assert_allclose(
        engine.score(images[0], images),
        engine.embed(images) @ engine.embed(images[0])[0],
        atol=1e-5,
    )


async def test_the_scheduler_serves_images_as_the_offline_path_does() -> None:
    online = Engine.from_pretrained(f"fake?dim=32&image_tokens={TOKENS}", dtype="float32")
    offline = online.embed([picture(1), "text"])
    async with online:
        result = await online.aembed([picture(1), "text"])
    np.testing.assert_allclose(result.embeddings, offline, atol=1e-6)
    assert result.token_counts[0] == TOKENS


async def test_admission_counts_an_image_by_its_tokens() -> None:
    small = Engine.from_pretrained(
        "fake?dim=16&max_len=64&image_tokens=48", dtype="float32", max_request_tokens=64
    )
    async with small:
        await small.aembed([picture(1)])
        with pytest.raises(TooManyTokensError):
            await small.aembed([picture(1), picture(2)])


def test_a_text_model_refuses_images() -> None:
    text_only = Engine.from_pretrained("fake?dim=16", dtype="float32")
    assert text_only.info().modalities == ["text"]
    with pytest.raises(InvalidRequestError) as caught:
        text_only.embed(["a", picture(1)])
    assert caught.value.param == "input[1]"
    assert "text only" in str(caught.value)


def test_the_handoff_gives_front_ends_the_image_processor_and_chat_template() -> None:
    """An ``--api-workers`` front-end preprocesses images and renders chat templates itself:
    both travel, pickled, in the engine's handoff."""
    import pickle

    from embedding_server.request.media.inputs import parse_messages

    engine = Engine.from_pretrained(f"fake?dim=16&image_tokens={TOKENS}&chat=true")
    handoff = pickle.loads(pickle.dumps(engine.handoff()))
    assert handoff.images is not None and handoff.chat is not None
    red = picture(1)
    np.testing.assert_array_equal(
        handoff.images.preprocess(red).pixels, FakeImageProcessor(TOKENS).preprocess(red).pixels
    )
    messages = parse_messages([{"role": "user", "content": "hi"}])
    assert engine.chat_template is not None
    assert handoff.chat.render(messages) == engine.chat_template.render(messages)
