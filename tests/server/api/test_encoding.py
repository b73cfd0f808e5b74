"""Binary element types, bit for bit: the request plane converts without torch, and must give
the bytes torch's own conversion gives (what vLLM sends)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from embedding_server.api.encoding import to_dtype_bytes

TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _values() -> np.ndarray:
    """Normal values at every scale, both formats' edges, and what lies beyond them."""
    rng = np.random.default_rng(0)
    scales = (1e-9, 1e-6, 1e-3, 0.1, 1.0, 10.0, 400.0, 1e4, 1e6)
    normal = np.concatenate([rng.standard_normal(20_000) * s for s in scales])
    edges = [0.0, -0.0, 448.0, 449.0, 463.9, 464.0, 480.0, 1e9, 57344.0, 61439.0, 61440.0]
    edges += [2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4]
    special = [np.inf, -np.inf, np.nan, -np.nan]
    return np.concatenate([normal, edges, np.negative(edges), special]).astype(np.float32)


@pytest.mark.parametrize("dtype", list(TORCH_FP8))
def test_fp8_bits_equal_torchs_conversion(dtype: str) -> None:
    values = _values()
    ours = to_dtype_bytes(values, dtype)  # type: ignore[arg-type]
    theirs = torch.from_numpy(values.copy()).to(TORCH_FP8[dtype]).view(torch.uint8).numpy()
    assert ours.dtype == np.uint8 and ours.shape == values.shape
    mismatched = np.nonzero(ours != theirs)[0]
    assert mismatched.size == 0, [(values[i], ours[i], theirs[i]) for i in mismatched[:5]]


def test_the_request_plane_converts_without_importing_torch() -> None:
    """The conversion runs in --api-workers front-ends, which never load torch (the import
    contract in pyproject.toml checks the source; this checks a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from embedding_server.api.encoding import to_dtype_bytes\n"
        "to_dtype_bytes(np.ones(4, np.float32), 'fp8_e4m3')\n"
        "to_dtype_bytes(np.ones(4, np.float32), 'fp8_e5m2')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
