"""Inductor's compiled C++ kernels reused by every venv of the same torch build, a clean clone's included.

Inductor keys a compiled C++ kernel by its source and its g++ command line (``CppCodeCache`` in
``torch._inductor.codecache``), and that command line names torch's headers and libraries by their absolute path,
inside the venv (``torch.utils.cpp_extension``'s ``_TORCH_PATH`` and ``TORCH_LIB_PATH``). A clean clone makes its
venv at a new path, so its run found none of the kernels earlier runs had compiled and compiled them all again
(its compiled-mode graphs still came from inductor's path-free graph caches): on a venv at a new path
tests/test_capture.py's compiled-engine test took 104 s against 12 s beside a warm cache. The test processes name
torch by a path of its build instead: a link under inductor's cache directory, named by torch's version and
commit, to this venv's torch. Venvs of one build have the same headers and libraries, so a kernel compiled
through another venv's link is the one this venv compiles.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def build_link(torch_dir: Path, cache_dir: Path, version: str, commit: str) -> Path:
    """``cache_dir/sidecar-torch/<version>-<commit>``, a link to ``torch_dir`` or to another venv's torch of the
    same build: made, or made again where it is broken or leads to another build, by an atomic rename."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{version}-{commit[:12]}")
    link = cache_dir / "sidecar-torch" / name
    if same_build(link, torch_dir):
        return link
    link.parent.mkdir(parents=True, exist_ok=True)
    staged = link.with_name(f"{name}.{os.getpid()}")
    staged.unlink(missing_ok=True)
    staged.symlink_to(torch_dir, target_is_directory=True)
    os.replace(staged, link)
    return link


def same_build(link: Path, torch_dir: Path) -> bool:
    """Whether ``link`` leads to a torch whose version.py (version, commit, CUDA and ROCm builds) is this one's."""
    try:
        return (link / "version.py").read_bytes() == (torch_dir / "version.py").read_bytes()
    except OSError:
        return False


def name_torch_by_its_build() -> Path | None:
    """Point the include and library paths of inductor's C++ compiles (and so their cache keys) at
    ``build_link``; returns the link, or None where it cannot be made or torch has no such paths (they stay
    torch's own)."""
    import torch
    import torch.utils.cpp_extension as cpp_extension
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if not all(hasattr(cpp_extension, name) for name in ("_TORCH_PATH", "TORCH_LIB_PATH")):
        return None  # a torch that names its paths otherwise: kernels compile as before, only slower
    try:
        cache = Path(cache_dir())
        link = build_link(Path(cpp_extension._TORCH_PATH), cache, torch.__version__,
                          torch.version.git_version or "unknown")
    except OSError:  # a cache directory this user cannot write: kernels compile as before, only slower
        return None
    cpp_extension._TORCH_PATH = str(link)
    cpp_extension.TORCH_LIB_PATH = str(link / "lib")
    return link
