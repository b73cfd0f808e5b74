"""Qwen2's dedicated reward models: Qwen2.5-Math-RM (``Qwen2ForRewardModel``) and
Qwen2.5-Math-PRM (``Qwen2ForProcessRewardModel``).

Their authors ship them as custom code (``modeling_qwen2_rm.py``), which is not run: each is
transformers' Qwen2Model (the native ``qwen2`` body) under a two-layer head,
``score = Sequential(Linear(hidden, hidden), ReLU, Linear(hidden, n))`` (``score.0``,
``score.2``), applied to every token's final state. vLLM's ``qwen2_rm.py`` reads the same
names and fixes ``n`` whatever ``num_labels`` says, so we do too: one output for the
outcome reward model, two (the step is wrong / right) for the process reward model.

What task reward answers follows vLLM: the outcome model's raw outputs at every token (its
ALL pooling, no activation; the last token's output is the reward the model card prints),
the process model's softmax at each step separator (its STEP pooling, at ``<extra_0>``: the
token the model card's code splits steps with, whose column 1 is the step's reward). The
head reader is here; the step selection is the request plane's (``Classifier.rewards``).
"""

from __future__ import annotations

from embedding_server.device.heads import ClassificationHead, HeadWeights, RewardReader
from embedding_server.request.pooling import PoolingMethod


def score_mlp_head(w: HeadWeights, per_token: bool) -> tuple[ClassificationHead, PoolingMethod]:
    """``score.0`` (with its ReLU) as the head's pooler, then ``score.2`` to the outputs; it
    runs on every token's state (the pooling is the last token's, which the outcome model's
    own forward pass returns as its reward)."""
    return ClassificationHead.read(w, "score.2.", "score.0.", pooler_activation="relu"), "last"


QWEN2_REWARD = RewardReader(
    head=score_mlp_head, outputs={"outcome": 1, "process": 2}, step_token="<extra_0>"
)
"""Qwen2.5-Math-RM-72B and Qwen2.5-Math-PRM-7B/72B."""
