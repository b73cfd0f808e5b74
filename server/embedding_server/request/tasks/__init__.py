"""The tasks an engine serves, one module each: its options, its request preparation (input
checks, the job it runs) and its result.

=================== ==========================================================================
:mod:`.embed`        pooled embeddings (``embed``, ``embed_full``)
:mod:`.token_embed`  per-token embeddings, bge-m3's and ColBERT's multi-vectors per token
:mod:`.hybrid_embed` a bge-m3-shaped model's dense, sparse and multi-vector outputs together
:mod:`.sparse`       SPLADE sparse vectors (and bge-m3's lexical weights)
:mod:`.score`        scores of pairs: cross-encoders, rerankers, MaxSim, cosine
:mod:`.rerank`       documents ranked by their scores against a query
:mod:`.classify`     class probabilities of single inputs
:mod:`.token_heads`  the classifier's head on every token: token_classify and reward
:mod:`.encode`       vLLM's ``LLM.encode``, one array per input for a pooling task
=================== ==========================================================================

Each takes a :class:`~.context.TaskContext` (the engine's configuration, model info, image
preprocessing and metrics, and the runner its jobs go to), never the engine: the
:class:`~embedding_server.request.serving.ServingEngine` only dispatches to them, on the
scheduler for its async API and offline for its sync one. :mod:`.colbert_jobs` is the
ColBERT preparation three of them share, :mod:`.media` what images and chat messages become
before a task runs, :mod:`.tokenize` the options of the engine's ``tokenize``. A new task is a
module here, its route (``api/``, through ``engine.serve``) and its docs.
"""
