"""The checksum of a directory tree: what "byte-identical workspaces" means.

Stdlib only and self-contained: the same function runs on the trainer's side over a prepared
workspace and inside a session's jail over its fork (its source is sent there), so the two can be
compared. It covers every path, its kind (file, directory, symlink, other), a file's bytes and
executable bit, and a symlink's target; it leaves out owners, times and the other mode bits (a
fork may change those without changing what a program reads or runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat


def tree_checksum(root: str) -> str:
    """`sha256:<hex>` of the tree under `root` (symlinks are not followed)."""
    total = hashlib.sha256()
    for entry in _entries(root):
        total.update(json.dumps(entry).encode("utf-8", "surrogateescape") + b"\n")
    return "sha256:" + total.hexdigest()


def _entries(root: str):
    """(kind, relative path, detail) of every entry under `root`, in a fixed (sorted) order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else rel_dir + "/" + name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                yield ["l", rel, os.readlink(path)]  # os.walk does not enter a linked directory
            elif stat.S_ISDIR(st.st_mode):
                yield ["d", rel, ""]
            elif stat.S_ISREG(st.st_mode):
                yield ["f", rel, ("x" if st.st_mode & 0o100 else "-") + _file_digest(path)]
            else:
                yield ["o", rel, stat.S_IFMT(st.st_mode)]


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":  # inside a session: `python -I -c <this source> /workspace`
    import sys

    print(tree_checksum(sys.argv[1]))
