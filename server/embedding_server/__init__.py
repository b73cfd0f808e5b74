"""embedding-server: a continuous-batching embedding server."""
