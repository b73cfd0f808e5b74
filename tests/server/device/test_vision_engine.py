"""CLIP, SigLIP and SigLIP 2 NaFlex through the whole engine: an image as a user sends it (a
PIL image through the model's own preprocessing,
``embedding_server.request.media.preprocessing``) beside a text in one request must come back
as transformers' processor + ``get_image_features``, cosine >= 0.99999 in float32; NaFlex at
the image's own patch grid.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from embedding_server.engine import Engine
from transformers import AutoImageProcessor, CLIPModel, Siglip2Model, SiglipModel

from tests.support.images import picture
from tests.support.vision import build_clip, build_siglip, build_siglip2, cosines

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("build", "reference"),
    [(build_clip, CLIPModel), (build_siglip, SiglipModel), (build_siglip2, Siglip2Model)],
    ids=["clip", "siglip", "siglip2-naflex"],
)
def test_an_image_as_sent_gets_transformers_vector(
    tmp_path: Path, build: Callable[[Path], Path], reference: type[torch.nn.Module]
) -> None:
    path = build(tmp_path / "model")
    engine = Engine.from_pretrained(str(path), dtype="float32", normalize=False)
    image = picture(5, (40, 28))  # not square: NaFlex keeps the aspect ratio
    out = engine.embed_full(["a photo", image])
    model = reference.from_pretrained(str(path)).eval()  # type: ignore[attr-defined]
    inputs = AutoImageProcessor.from_pretrained(str(path))(images=image, return_tensors="pt")
    with torch.no_grad():
        want = model.get_image_features(**inputs).pooler_output[0].numpy()
    assert cosines(out.embeddings[1:2], want[None])[0] >= 0.99999
    assert engine.info().modalities == ["text", "image"]
    assert out.token_counts[1] <= (engine.info().image_tokens or 0)
    assert np.isfinite(out.embeddings).all()
