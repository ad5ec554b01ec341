"""The run report: one self-contained HTML page (plots embedded) rendered from events.

``render_report(events_or_path, out_dir)`` writes ``index.html``, ``events.jsonl``
(when given events), and the PNG plots beside it; every image is also embedded in the
page as a data URI, so the page needs no network and no other file. Everything that
comes from the event log (module names, sources, messages, paths) is HTML-escaped.
A malformed line of a log is listed with its line number; the rest still renders.

Read top-down: the verdict (earned: "healthy" only with a finite end state, the loss
back within its band of the pre-incident level and the LR factor recovered; otherwise
what is still wrong, or died at step N and why: :mod:`floatguard.report.verdict`), the
loss, gradient-norm and learning-rate timelines with skip, rollback and fault markers,
the loss-scale trajectory, one card per fault, and the diagnosis.
"""

from __future__ import annotations

from floatguard.report.page import Verdict, render_report, verdict_of

__all__ = ["Verdict", "render_report", "verdict_of"]
