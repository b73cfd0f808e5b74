"""Helpers shared by the unit tests, imported by package path (``tests.support.models``).

* ``models``: tiny random Hugging Face models built on the fly, and the packaged MiniLM.
* ``tasks``: tiny random classifiers (sequence and token) and SPLADE encoders of each family.
* ``attention``: a recording stand-in for flash-attn's varlen kernel and its reference mask.
* ``api``: a real uvicorn server on a free loopback port, and metric scraping.
* ``operator``: the operator's test doubles (render inputs, an in-memory API server).
"""
