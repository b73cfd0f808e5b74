"""embedding-operator: reconciles EmbeddingService resources into embedding-server deployments."""
