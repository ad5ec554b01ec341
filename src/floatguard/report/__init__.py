"""The run report: one self-contained HTML page (plots embedded) rendered from events.

``render_report(events_or_path, out_dir)`` writes ``index.html``, ``events.jsonl``
(when given events), and the PNG plots beside it; every image is also embedded in the
page as a data URI, so the page needs no network and no other file. Everything that
comes from the event log (module names, sources, messages, paths) is HTML-escaped.
A malformed line of a log is listed with its line number; the rest still renders.

Read top-down: the verdict (healthy / recovered from N faults / died at step N, and
why), the loss and gradient-norm timelines with skip, rollback and fault markers, the
loss-scale trajectory, one card per fault, and the diagnosis.
"""

from __future__ import annotations

from floatguard.report.page import Verdict, render_report, verdict_of

__all__ = ["Verdict", "render_report", "verdict_of"]
