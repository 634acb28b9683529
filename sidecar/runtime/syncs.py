"""Counting the points where the host waits for the device, on any device, a CPU included.

A GPU runs behind the Python that queues its work; it stalls whenever the host needs a value back before
it can queue more: ``.item()``, ``.tolist()``, ``int(t)``/``float(t)``/``bool(t)``, a tensor used as a
Python index, ``.cpu()``/``.numpy()``, a result whose shape depends on the data (``nonzero``, boolean
masks), a blocking copy of host data to the device (``torch.tensor(..., device=...)``), or an explicit
synchronize. On a CPU nothing stalls, but the code makes the same calls, so counting them there says what
a GPU will do. ``SyncCounter`` counts them per call site: the first frame outside torch and this module.

``synchronize`` (below) does nothing on a CPU; the counter counts its calls from sidecar and bench
modules anyway, since on a GPU each one is a synchronize.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import FrameType, ModuleType

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and torch functions that hand a device value to the host
TO_HOST = frozenset({
    "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__complex__", "__array__", "cpu", "numpy",
    "equal", "allclose", "is_nonzero",
    # the size of their result depends on the data
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
})
# indexing with a boolean mask is a nonzero
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
# built from host data and copied to the device before they return
FROM_HOST = frozenset({"tensor", "as_tensor"})

_TORCH = str(Path(torch.__file__).parent)
_THIS = __file__
_TRANSFERS = str(Path(__file__).with_name("transfers.py"))
_REPO = str(Path(__file__).resolve().parents[2])


def _is_bool_index(index: object) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, tuple | list):
        return any(_is_bool_index(i) for i in index)
    return False


def _site(frame: FrameType | None) -> str:
    """``path:line (function)`` of the first frame outside torch, contextlib, this module and ``to_host`` (whose
    caller is the read's site)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH) or path in (_THIS, _TRANSFERS)
                or path.endswith(("contextlib.py", "functools.py"))):
            break
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    if path.startswith(_REPO + "/"):
        path = path[len(_REPO) + 1 :]
    elif "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as syncs:`` counts every host-device synchronisation made inside, by call site.

    ``syncs.sites`` maps ``"path:line (function) kind"`` to a count; ``syncs.total`` sums them. The count
    is of this thread's torch calls (torch function modes are per thread).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self._patched: list[tuple[object, str, object]] = []

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def busiest(self, top: int = 20) -> str:
        """The busiest call sites, one a line: what a failing budget test prints."""
        return "\n".join(f"{n:6d}  {site}" for site, n in self.sites.most_common(top))

    def _count(self, kind: str, frame: FrameType | None) -> None:
        self.sites[f"{_site(frame)} {kind}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in TO_HOST:
            self._count(name, sys._getframe(1))
        elif name in INDEXING and len(args) > 1 and _is_bool_index(args[1]):
            self._count(f"{name}[bool]", sys._getframe(1))
        elif name in FROM_HOST and kwargs.get("device") is not None:
            self._count(f"{name}(device=)", sys._getframe(1))
        return func(*args, **kwargs)

    # -- explicit synchronize calls, which are no torch functions --

    def _wrap(self, owner: object, attribute: str, kind: str, on_cpu_only: bool = False) -> None:
        original = getattr(owner, attribute)
        counter = self

        def counted(*args, **kwargs):
            # synchronize on a GPU reaches torch.cuda.synchronize, which counts it
            if not on_cpu_only or getattr(args[0] if args else kwargs.get("device"), "type", "cpu") != "cuda":
                counter._count(kind, sys._getframe(1))
            return original(*args, **kwargs)

        self._patched.append((owner, attribute, original))
        setattr(owner, attribute, counted)

    def __enter__(self) -> SyncCounter:
        self._wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
        self._wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
        self._wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize")
        # every module that imported synchronize by name, this one included
        for module in list(sys.modules.values()):
            if (isinstance(module, ModuleType) and module.__name__.split(".")[0] in {"sidecar", "bench"}
                    and getattr(module, "synchronize", None) is synchronize):
                self._wrap(module, "synchronize", "synchronize", on_cpu_only=True)
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for owner, attribute, original in reversed(self._patched):
            setattr(owner, attribute, original)
        self._patched.clear()


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure it (CPU work is synchronous already)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
