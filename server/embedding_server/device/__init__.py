"""The device plane: everything that imports torch.

The model families and their shared layers (``models/``), attention kernels, dtypes and
devices, loading checkpoints, the forward runner, tensor parallelism, the fake backend, and the
torch halves of pooling, heads and configuration. Only the engine process imports it; the
request plane (HTTP, tokenization, scheduling, results) never does, which an import-linter
contract in pyproject.toml enforces, so ``--api-workers`` front-ends never load the model
runtime.
"""
