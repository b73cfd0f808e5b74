"""The gateway: one address for every model, routed by the request's ``model`` field.

``embedding-server gateway`` runs this package alone. It is request plane only (the
import-linter contract in pyproject.toml keeps torch and the device plane out), so the
gateway starts in milliseconds and needs no model files. Its pieces, each behind a small
interface so the Kubernetes parts can be swapped for a file in tests and benchmarks:

- ``discovery``: which models exist, their names and aliases, and their endpoints
  (:class:`~embedding_server.gateway.discovery.StaticDiscovery` from flags or a file,
  :class:`~embedding_server.gateway.kubernetes.KubernetesDiscovery` from EmbeddingServices
  and EndpointSlices).
- ``balancer``: each endpoint's load, polled from the server's ``GET /load`` and added to
  the gateway's own in-flight work, and the least-backlog pick (power of two choices).
- ``holding``: requests for a model with no ready endpoint wait, bounded, until one appears.
- ``proxy``: the HTTP front, which forwards bodies untouched and retries what a dying pod
  dropped.
"""
