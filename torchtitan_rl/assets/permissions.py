"""Files we write get the user's umask, like a plain ``open()`` / ``mkdir()`` would give them.

Two writers do not: ``tempfile.mkdtemp`` makes its directory 0700 (the write-then-rename pattern
of a model directory keeps that mode after the rename), and safetensors' ``save_file`` (which
``save_pretrained`` uses) writes its file 0600. On a shared file system another user, or a
generator host running as another account, then cannot read the model. `share_like_umask` gives
such a file 0o666 & ~umask and such a directory 0o777 & ~umask (0644 / 0755 under umask 022).
"""

from __future__ import annotations

import logging
import os
import pathlib
import stat

logger = logging.getLogger(__name__)


def current_umask() -> int:
    """This process's umask. Read from /proc where Linux reports it: ``os.umask`` can only be
    read by setting it, which races with threads creating files meanwhile."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_umask(path: str | os.PathLike) -> None:
    """Set ``path`` (and, for a directory, everything under it) to the mode a plain create
    would have given: files 0o666 & ~umask, directories 0o777 & ~umask. Symlinks are left
    alone. Only for what this process just wrote (a file another user owns cannot be chmod'ed)."""
    mask = current_umask()
    root = pathlib.Path(path)
    paths = [root, *root.rglob("*")] if root.is_dir() and not root.is_symlink() else [root]
    for p in paths:
        mode = p.lstat().st_mode
        if stat.S_ISDIR(mode):
            os.chmod(p, 0o777 & ~mask)
        elif stat.S_ISREG(mode):
            os.chmod(p, 0o666 & ~mask)


def is_private(path: str | os.PathLike) -> bool:
    """Whether ``path`` is ours and unreadable to group and others while the umask would let them
    read it: a directory written before `share_like_umask` existed (made with mkdtemp)."""
    st = pathlib.Path(path).stat()
    return (st.st_uid == os.getuid() and not st.st_mode & 0o044
            and bool(0o044 & ~current_umask()))
