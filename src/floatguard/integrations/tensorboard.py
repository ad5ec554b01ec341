"""The guard's event stream in TensorBoard (the ``floatguard[tensorboard]`` extra).

```python
from floatguard.integrations.tensorboard import TensorBoardSink
sink = TensorBoardSink("runs/exp1").attach(guard)   # live, from now on
...
export("run.jsonl", "runs/exp1")                   # or afterwards, from a saved log
```

Scalars under ``floatguard/``: ``loss``, ``grad_norm`` (before clipping), ``clip_coef``,
``loss_scale``, ``lr_factor``, ``action`` (0 applied, 1 skipped, 2 rolled back) and the
running totals ``skipped``, ``rolled_back``, ``faults``, ``overflows``, ``spikes``; per
sampled tensor (``Guard(stats_every=k)``) ``amax/<module>/<role>``. Histograms:
``exponents/<module>/<role>``, the sampled tensor's exponent histogram (one bucket per
binade, ``floor(log2|x|)``). Text: ``fault`` (where each was born), ``rollback``,
``stop``. A non-finite loss is written as it is (TensorBoard shows NaN as a gap).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

from floatguard.events import Event, EventLog, read_events
from floatguard.integrations import require

_tb = require("torch.utils.tensorboard", "tensorboard", "floatguard.integrations.tensorboard")

__all__ = ["TensorBoardSink", "export"]

_ACTION_CODE = {"applied": 0, "skipped": 1, "rolled_back": 2}


class TensorBoardSink:
    """Writes guard events to a ``SummaryWriter`` (given, or made for ``log_dir``)."""

    def __init__(self, writer_or_log_dir: Any, *, prefix: str = "floatguard") -> None:
        if isinstance(writer_or_log_dir, (str, os.PathLike)):
            self.writer = _tb.SummaryWriter(log_dir=str(writer_or_log_dir))
            self._owns = True
        else:
            self.writer = writer_or_log_dir
            self._owns = False
        self.prefix = prefix
        self.totals: Counter[str] = Counter()

    def attach(self, source: Any) -> TensorBoardSink:
        """Receive every event of ``source`` (a :class:`~floatguard.Guard` or an
        :class:`~floatguard.events.EventLog`) from now on."""
        log = getattr(source, "events", source)
        if not isinstance(log, EventLog):
            raise TypeError(f"attach() needs a Guard or an EventLog, got {type(source).__name__}")
        log.subscribe(self)
        return self

    def _scalar(self, name: str, value: Any, step: int) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.writer.add_scalar(f"{self.prefix}/{name}", float(value), step)

    def __call__(self, ev: Event) -> None:
        k, s, f = ev.kind, ev.step, ev.fields
        if k == "step":
            for name, key in (("loss", "loss"), ("grad_norm", "grad_norm"),
                              ("clip_coef", "clip_coef"), ("loss_scale", "scale"),
                              ("lr_factor", "lr_factor")):  # fmt: skip
                self._scalar(name, f.get(key), s)
            action = f.get("action")
            self._scalar("action", _ACTION_CODE.get(str(action), -1), s)
            if action in ("skipped", "rolled_back"):
                self.totals[str(action)] += 1
            for name in ("skipped", "rolled_back"):
                self._scalar(name, self.totals[name], s)
        elif k in ("fault", "overflow", "spike"):
            self.totals[k + "s"] += 1
            self._scalar(k + "s", self.totals[k + "s"], s)
            if k == "fault":
                on = f" on rank {f['fault_rank']}" if f.get("fault_rank") is not None else ""
                text = (f"{f.get('kind_of_value')} born in `{f.get('module') or '<root>'}`{on} "
                        f"({f.get('phase')}, {f.get('tensor')}) by {f.get('op')} at "
                        f"{f.get('source')}")  # fmt: skip
                self.writer.add_text(f"{self.prefix}/fault", text, s)
        elif k in ("rollback", "stop"):
            body = ", ".join(f"{a}={b}" for a, b in f.items())
            self.writer.add_text(f"{self.prefix}/{k}", body, s)
        elif k == "stats":
            for t in f.get("tensors") or []:
                self._tensor(t, s)

    def _tensor(self, t: dict[str, Any], step: int) -> None:
        where = f"{t.get('module') or 'root'}/{t.get('role')}"
        self._scalar(f"amax/{where}", t.get("amax"), step)
        hist = t.get("hist") or []
        if not hist or sum(hist) == 0:
            return
        lo = int(t["hist_from"])
        exps = [lo + i for i in range(len(hist))]
        n = float(sum(hist))
        self.writer.add_histogram_raw(
            f"{self.prefix}/exponents/{where}", min=float(exps[0]), max=float(exps[-1]),
            num=n, sum=float(sum(e * c for e, c in zip(exps, hist, strict=True))),
            sum_squares=float(sum(e * e * c for e, c in zip(exps, hist, strict=True))),
            bucket_limits=[float(e + 1) for e in exps], bucket_counts=[float(c) for c in hist],
            global_step=step,
        )  # fmt: skip

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this sink made it."""
        self.writer.flush()
        if self._owns:
            self.writer.close()


def export(
    logs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], log_dir: str | os.PathLike[str]
) -> int:
    """Write saved event logs (JSONL; one per rank is fine: rank r > 0 goes to
    ``<log_dir>/rank<r>``) to TensorBoard; returns the number of events written."""
    paths = [logs] if isinstance(logs, (str, os.PathLike)) else list(logs)
    sinks: dict[int, TensorBoardSink] = {}
    n = 0
    try:
        for p in paths:
            for ev in read_events(p):
                sink = sinks.get(ev.rank)
                if sink is None:
                    where = log_dir if ev.rank == 0 else os.path.join(log_dir, f"rank{ev.rank}")
                    sink = sinks[ev.rank] = TensorBoardSink(where)
                sink(ev)
                n += 1
    finally:
        for sink in sinks.values():
            sink.close()
    return n
