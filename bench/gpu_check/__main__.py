"""``python -m bench.gpu_check`` (``make gpu-check``): run the check; exit non-zero naming every pair that failed to
load and every part that raised."""

from __future__ import annotations

import sys

from bench.gpu_check.main import main
from bench.gpu_check.parts import errors

if __name__ == "__main__":
    failures = errors(main())
    if failures:
        sys.exit("gpu check parts failed: " + "; ".join(failures))
