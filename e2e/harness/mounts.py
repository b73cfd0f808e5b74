"""The mounts below a directory, and unmounting them: what containerd (the node's pods),
debootstrap (the base image's rootfs) and the private dockerd leave mounted under their
directories."""

from __future__ import annotations

import subprocess
from pathlib import Path


def mounts_under(*roots: Path) -> list[str]:
    """The mount points below ``roots`` now (not ``roots`` themselves), deepest first."""
    prefixes = [str(r.resolve()) + "/" for r in roots]
    mounts = [
        line.split()[1].encode().decode("unicode_escape")
        for line in Path("/proc/mounts").read_text().splitlines()
    ]
    return sorted(
        {m for m in mounts if any(m.startswith(p) for p in prefixes)}, key=len, reverse=True
    )


def unmount_under(*roots: Path) -> list[str]:
    """Unmount everything mounted below ``roots`` (deepest first, lazily, up to three rounds);
    the paths that stayed."""
    stuck: list[str] = []
    for _ in range(3):
        ours = mounts_under(*roots)
        if not ours:
            return []
        stuck = []
        for mount in ours:
            proc = subprocess.run(
                ["umount", "-l", mount], capture_output=True, timeout=30, check=False
            )
            if proc.returncode != 0:
                stuck.append(mount)
    return stuck
