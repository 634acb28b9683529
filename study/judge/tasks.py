"""Whether the judge can score a sidecar task in a run, decided from the task's outputs there.

A verdict is only worth its control ladder (``study.judge.controls``): the easy rung shows that the judge tells a
document's own output from another document's, the null rung measures its own noise on an output against itself
reordered. A task whose outputs give neither cannot be proved, whatever the judge: it is *not judged*, with the
reason, which is no verdict and not an unreliable one. This is read from the data, not from the kind of task:
a ``choices`` task whose documents all got one label has no control, and one whose labels are single words has
no null game, while the same task with multi-part labels ("sport, local") has both.
"""

from __future__ import annotations

from study.judge.controls import canonical_output, control_foils, null_tags
from study.judge.results import JudgeItem


def not_judged_reason(items: list[JudgeItem], controls: int) -> str | None:
    """Why the judge cannot score the task of ``items`` (one task's documents of a run), or None when it can.

    The control sample is the first ``controls`` documents with both outputs, as the judge takes it; with
    ``controls`` 0 the caller asked for no ladder, and only the outputs themselves are checked."""
    comparable = [item for item in items if item.comparable]
    if not comparable:
        return "no document has both a sidecar and a standalone output that parsed, so there is nothing to compare"
    if controls == 0:
        return None
    sample = comparable[:controls]
    distinct = {canonical_output(item.sidecar_tags) for item in sample}
    if len(distinct) < 2 or not control_foils([(item.doc_id, item.sidecar_tags) for item in sample], controls):
        shown = canonical_output(sample[0].sidecar_tags)
        return (f"every document of its control sample ({len(sample)}) has the same sidecar output ({shown[:80]}), "
                "so there is no control: nothing can show that the judge tells a document's own output from "
                "another's")
    if all(null_tags(item.sidecar_tags) is None for item in sample):
        return (f"none of the {len(sample)} sidecar outputs of its control sample can be reordered without changing "
                "it (one tag, a one-word label, a one-part text), so the null rung, which measures the judge's own "
                "noise, has nothing to compare")
    return None
