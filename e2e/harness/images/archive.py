"""Small images written by hand as `docker save` archives, for tests that need an image in a
containerd of their own without a build (``ctr images import`` reads them)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path


def tar(members: dict[str, bytes], *, mode: int = 0o644) -> bytes:
    """A tar of these files (all with ``mode``)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def docker_archive(path: Path, layers: list[bytes], *, tag: str, cmd: list[str]) -> None:
    """A `docker save` archive at ``path`` of the image ``tag``: these layers, this command."""
    members: dict[str, bytes] = {}
    diff_ids = []
    for layer in layers:
        digest = hashlib.sha256(layer).hexdigest()
        diff_ids.append(f"sha256:{digest}")
        members[f"{digest}/layer.tar"] = layer
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": cmd},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    members[f"{config_digest}.json"] = config
    manifest = [
        {
            "Config": f"{config_digest}.json",
            "RepoTags": [tag],
            "Layers": [f"{d.removeprefix('sha256:')}/layer.tar" for d in diff_ids],
        }
    ]
    members["manifest.json"] = json.dumps(manifest).encode()
    path.write_bytes(tar(members))
