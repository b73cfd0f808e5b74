"""Bulk work in the OpenAI batch file format: ``embedding-server run-batch``.

Each input line is one request, ``{"custom_id", "method", "url", "body"}``; each output line
is its answer, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``, matched by ``custom_id`` (OpenAI's Batch API and vLLM's ``run-batch`` use the same
shapes). The package knows nothing of models: ``lines`` parses and shapes lines, ``output``
keeps the output file resumable, and ``runner`` sends the requests to an HTTP application
through an ``httpx2`` client, so the same loop serves the engine in this process (the CLI's
``run-batch``, through ``httpx2.ASGITransport``) and a server elsewhere.
"""
