"""Front-end processes and the engine process (``--api-workers N``): the wire between them.

With N front-ends, each runs the engine's request-level code (inputs, prompts, truncation,
tokenization, the per-request head, results) and hands the engine process only what its
scheduler takes: token ids. The engine process owns the model and the one
:class:`~embedding_server.request.scheduler.Scheduler`, so a batch holds sequences of every
front-end. Nothing per request is pickled, and nothing is a Python list on the wire.

* :mod:`.messages`: every message, one typed definition each, and the buffers they carry;
* :mod:`.wire`: the framing over a unix socket;
* :mod:`.client`: the front-end's end (its connection, admission against the engine's
  queue, and the :class:`~.client.AttachedEngine` its HTTP API serves).

* :mod:`.service`: the engine process's end, serving every front-end from the one scheduler
  (torch-free, like the rest of this package).
"""
