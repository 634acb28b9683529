"""The ways a run produces a document's sidecar output; defined once, stored by ``storage``.

* ``sidecar``: the draft writes the task after the summary, with the document's KV evicted;
* ``sidecar_attended``: the same, still attending to the document;
* ``standalone``: the draft as a separate tagger, prompted with only the summary.
"""

from __future__ import annotations

from typing import Literal, get_args

Mode = Literal["sidecar", "sidecar_attended", "standalone"]
MODES: tuple[Mode, ...] = get_args(Mode)
# the modes whose output comes from the speculative run's own draft cache
SIDECAR_MODES: tuple[Mode, ...] = ("sidecar", "sidecar_attended")
