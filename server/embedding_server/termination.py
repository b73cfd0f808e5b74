"""What the pod's status says about why the server exited: Kubernetes' termination message.

On Kubernetes the kubelet mounts a writable ``/dev/termination-log`` into every container and
copies what the process wrote there into the pod's ``lastState.terminated.message``. A server
that could not load its model writes one fixed line there before it exits 1, so the operator
can tell a model that will not load from any other crash (``ModelLoadFailed`` in the
EmbeddingService's status, and the restarts it counts by reason) without reading logs. Fixed
text only: the pod's status is readable by more people than its log, and a load error may
quote a path or a value that came from a Secret; the log says why.

Elsewhere (no such file: a laptop, the tests) nothing is written.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

TERMINATION_LOG = Path("/dev/termination-log")
MODEL_LOAD_FAILED = "embedding-server: the model could not be loaded; the log says why"
"""The whole message: the operator matches its first words (keep them)."""


def report_model_load_failure(path: Path | None = None) -> None:
    """Leave :data:`MODEL_LOAD_FAILED` where the kubelet reads it, if this is a container."""
    path = path if path is not None else TERMINATION_LOG
    if not path.exists():
        return
    try:
        path.write_text(MODEL_LOAD_FAILED + "\n", encoding="utf-8")
    except OSError as exc:  # a read-only or odd mount: the exit status still says it failed
        logger.debug("could not write %s: %s", path, exc)
