"""The ``floatguard`` command line: ``demo``, ``report``, ``diagnose``, ``audit``,
``repro``, ``formats``, ``explain``.

User mistakes (a bad option, a missing file, an unwritable or full folder, an unknown
command, an audit target that fails) are one red line on stderr and exit code 2,
never a traceback. Anything else is floatguard's bug: one line saying so, exit code
1, and ``--debug`` (anywhere on the line) or ``FLOATGUARD_DEBUG=1`` shows the
traceback. Ctrl-C prints "interrupted" and exits 130.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import shlex
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from floatguard.demo.lines import EventLines, printable
from floatguard.demo.run import FAULTS, MAX_SEED, MAX_STEPS, MIN_STEPS
from floatguard.formats import FORMATS, explain, get
from floatguard.formats.explain import parse_value

app = typer.Typer(
    name="floatguard",
    help="Keep deep-learning training numerically healthy.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_out = Console(highlight=False)
if not _out.is_terminal:
    _out = Console(highlight=False, width=160)  # piped output: don't squeeze tables to 80
_err = Console(stderr=True, highlight=False, soft_wrap=True)
_DEBUG_ENV = "FLOATGUARD_DEBUG"
# what a full, read-only or forbidden disk raises: the user's to fix, not a bug
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT})


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Report a user mistake as one red line; the caller raises the returned Exit(2).

    The message is made printable (a value from the command line may hold an ESC or
    a newline) and shown as text, not rich markup (a ``[/x]`` in it stays as typed)."""
    _err.print(f"[red]error:[/red] {escape(printable(message, 2000))}", markup=True)
    return typer.Exit(code=code)


def _what(e: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    text = str(e)
    return f"{type(e).__name__}: {printable(text, 300)}" if text else type(e).__name__


def _write_failed(e: OSError, fallback: Path) -> typer.Exit:
    """One line for a write that failed (a full, read-only or forbidden disk)."""
    where = e.filename if e.filename else fallback
    return _fail(f"cannot write {str(where)!r}: {e.strerror or e}")


class _TargetFailed(Exception):
    """The user's code (an audit target's model or loss_fn) raised during the audit: one
    line naming the target, and the traceback with --debug; not floatguard's bug."""


@app.callback()
def _root(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help=f"On an internal error, show the traceback (also {_DEBUG_ENV}=1; "
            "accepted anywhere on the line).",
        ),
    ] = False,
) -> None:
    """Keep deep-learning training numerically healthy."""
    # --debug is read by main() before the command line is parsed, so that it works
    # after the command too; it is declared here for --help


def _out_dir(value: str, option: str = "--out") -> Path:
    """The folder an --out names; an empty one is refused (Path("") is the current
    folder, and a demo would then replace ./events.jsonl without a word)."""
    if not value.strip():
        raise _fail(f"{option} is empty; give a folder, e.g. {option} floatguard-demo")
    folder = Path(value)
    if folder.is_symlink() and not folder.exists():
        raise _fail(f"{option} {value!r} is a broken link; give a folder")
    if folder.exists() and not folder.is_dir():
        raise _fail(f"{option} {value!r} is a file, not a folder; give a folder")
    return folder


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if math.isnan(v) or math.isinf(v) or v == 0:
        return str(v)
    a = abs(v)
    if a >= 1e6 or a < 1e-4:
        return f"{v:.6g}"
    return f"{v:.10g}"


@app.command()
def formats(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Print the table of every format floatguard knows, with its exact limits."""
    if as_json:
        from floatguard.events import encode_value

        print(json.dumps(encode_value([f.summary() for f in FORMATS.values()]), allow_nan=False))
        return
    table = Table(title="Floating-point formats (exact limits)")
    for col in ("format", "bits", "exp", "mant", "bias", "max", "min normal", "min subnormal"):
        table.add_column(col, justify="right" if col != "format" else "left")
    for col in ("eps", "~digits", "inf", "NaN", "torch dtype"):
        table.add_column(col, justify="right")
    for f in FORMATS.values():
        table.add_row(
            f.name,
            str(f.bits),
            str(f.exponent_bits),
            str(f.mantissa_bits),
            str(f.bias),
            _num(f.max),
            _num(f.tiny),
            _num(f.smallest_subnormal) if f.has_subnormals else "-",
            _num(f.eps),
            f"{f.decimal_digits:.2f}",
            "yes" if f.has_inf else "no",
            {"ieee": "yes", "fn": "one code", "fnuz": "in -0 code", "none": "no"}[f.special],
            str(f.torch_dtype).replace("torch.", "") if f.torch_dtype is not None else "-",
        )
    _out.print(table)


def _looks_negative(arg: str) -> bool:
    """A command-line word that is a negative number (``-inf``, ``-0x1.fp3``, ``-.5``),
    not a cluster of short options."""
    rest = arg[1:].lower()
    return arg.startswith("-") and (
        rest[:1].isdigit() or rest[:1] == "." or rest[:3] in ("inf", "nan")
    )


class _ValueFirst(TyperCommand):
    """``explain``'s parser. Click reads ``-inf`` as the options ``-i -n -f`` (and ``-f``
    then eats the next word); a VALUE that is a negative number is moved behind a
    ``--``, where it can only be the argument. ``explain -- -inf`` works as usual."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # ctx: click's Context
        if "--" not in args:
            for i, arg in enumerate(args):
                taken = i > 0 and args[i - 1] in ("-f", "--format")  # a --format's value
                if _looks_negative(arg) and not taken:
                    args = [*args[:i], *args[i + 1 :], "--", arg]
                    break
        return super().parse_args(ctx, args)


def _formats_named(spec: str) -> list[Any]:
    """The formats of a --format list, each looked up by name; ValueError names the bad one."""
    names = [n for n in (s.strip() for s in spec.split(",")) if n]
    if not names:
        raise ValueError("--format is empty; give e.g. --format fp32,bf16")
    found = []
    for name in names:
        try:
            found.append(get(name))
        except OverflowError:  # an eXmY whose widths no int holds: e99999999999999999999m1
            raise ValueError(
                f"--format {name!r}: its widths are out of range (eXmY goes up to e11m52)"
            ) from None
    return found


@app.command(name="explain", cls=_ValueFirst, context_settings={"ignore_unknown_options": True})
def explain_cmd(
    value: Annotated[str, typer.Argument(help="A number: 0.1, 1e-8, 0x1.cp8, inf, nan.")],
    fmt: Annotated[
        str,
        typer.Option("--format", "-f", help="Comma-separated formats, e.g. fp32,bf16,fp16,e4m3fn."),
    ] = "fp32,bf16,fp16,e4m3fn",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Explain how VALUE is stored in each format: bits, class, error, neighbours.

    A negative VALUE may come first or last: ``explain -inf -f fp16``, or after
    ``--``: ``explain -f fp16 -- -inf``."""
    try:
        v = parse_value(value)
        results = [explain(v, f) for f in _formats_named(fmt)]
    except (ValueError, TypeError, OverflowError) as e:
        raise _fail(str(e)) from None
    if as_json:
        # strict JSON: non-finite floats tagged as the event stream writes them
        from floatguard.events import encode_value

        print(json.dumps(encode_value([r.to_dict() for r in results]), default=str))
        return
    # Formats side by side: one column each, one row per property.
    title = f"{printable(value, 60)} stored in {', '.join(r.format for r in results)}"
    table = Table(title=escape(title))
    table.add_column("")
    for r in results:
        table.add_column(r.format, justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("sign | exponent | mantissa", [r.bits for r in results]),
        ("stored value", [repr(r.stored) for r in results]),
        ("class", [r.klass + (" (underflow)" if r.underflow else "") for r in results]),
        (
            "exponent (unbiased)",
            ["-" if r.exponent_unbiased is None else str(r.exponent_unbiased) for r in results],
        ),
        ("absolute error", [_num(r.abs_error) for r in results]),
        ("relative error", [_num(r.rel_error) for r in results]),
        ("ulp", [_num(r.ulp) for r in results]),
        ("next down", [_num(r.next_down) for r in results]),
        ("next up", [_num(r.next_up) for r in results]),
    ]
    for label, cells in rows:
        table.add_row(label, *cells)
    _out.print(table)


def _show(lines: EventLines) -> Callable[[Any], None]:
    """The demo's event listener: each event's lines (if any) printed as they come;
    above the progress bar in the live view, as log lines with --no-live."""

    def on_event(ev: Any) -> None:
        for line in lines.feed(ev):
            _out.print(line.text, style=line.style or None, markup=False, soft_wrap=True)

    return on_event


def _live_demo(lines: EventLines, **kwargs: Any) -> Any:
    """Run the demo with a rich progress bar; event lines print above it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from floatguard.demo.run import run_demo

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=_out,
    )
    task = progress.add_task("training", total=kwargs["steps"], status="")

    def on_step(step: int, r: Any, loss: float) -> None:
        status = f"loss {loss:.4f}"
        if r is not None:
            status += f"  scale {r.scale:g}  |g| {r.grad_norm:.3g}"
        progress.update(task, completed=step + 1, status=status)

    with progress:
        return run_demo(on_step=on_step, on_event=_show(lines), **kwargs)


def _demo_log(out: Path, force: bool) -> Path:
    """``out/events.jsonl``, ready to be written: the folder made and probed with a
    byte; a log already there (an earlier run's) refused unless ``force``."""
    log = out / "events.jsonl"
    if log.is_dir() and not log.is_symlink():
        raise _fail(f"{str(log)!r} is a folder; remove it, or choose another --out")
    try:
        if (log.exists() or log.is_symlink()) and not force:
            raise _fail(
                f"{str(log)!r} holds an earlier run's event log; pass --force to replace "
                "it, or choose another --out"
            )
        if out.exists() and not out.is_dir():
            raise _fail(f"--out {str(out)!r} is a file, not a folder; choose a folder")
        out.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)  # a link there: the link goes, not what it names
        fd, probe = tempfile.mkstemp(prefix=".floatguard-write-test.", dir=out)  # a new file
        try:
            os.write(fd, b"x")  # a byte: a full disk refuses it now, not mid-run
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise _fail(f"--out {str(out)!r} is not a writable folder ({e.strerror or e})") from None
    return log


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help=f"Training steps, {MIN_STEPS}..{MAX_STEPS:,}.")] = 400,
    precision: Annotated[
        str, typer.Option(help="fp16 (with loss scaling), bf16 or fp32.")
    ] = "fp16",
    faults: Annotated[
        str, typer.Option(help="default, none, or names: corrupt_batch,bit_flip,masked_row,...")
    ] = "default",
    seed: Annotated[
        int, typer.Option(help="Seed of the model, the data and the schedule (0..2**63-1).")
    ] = 0,
    out: Annotated[str, typer.Option(help="Folder for the report.")] = "floatguard-demo",
    force: Annotated[
        bool, typer.Option("--force", help="Replace an earlier run's events.jsonl in --out.")
    ] = False,
    unguarded: Annotated[
        bool, typer.Option("--unguarded", help="The same schedule without the guard.")
    ] = False,
    no_live: Annotated[bool, typer.Option("--no-live", help="Log lines, no live view.")] = False,
) -> None:
    """Train a tiny GPT under fp16 with a fault schedule; find, localize and answer each fault."""
    from floatguard.demo.run import run_demo, schedule_for

    if precision not in ("fp16", "bf16", "fp32"):
        raise _fail(f"--precision {precision!r}; use fp16, bf16 or fp32")
    if not MIN_STEPS <= steps <= MAX_STEPS:
        raise _fail(
            f"--steps {steps}: use {MIN_STEPS}..{MAX_STEPS:,} (the fault schedule needs "
            f"{MIN_STEPS}; more is a training job, not a demo)"
        )
    if not 0 <= seed <= MAX_SEED:
        raise _fail(f"--seed {seed}: use an int in 0..{MAX_SEED} (torch seeds are 64-bit)")
    names = {"default": list(FAULTS), "none": []}.get(faults)
    if names is None:
        names = [f.strip() for f in faults.split(",") if f.strip()]
        unknown = [f for f in names if f not in FAULTS]
        if unknown:
            raise _fail(f"--faults: unknown fault {unknown[0]!r}; known: {', '.join(FAULTS)}")
    folder = _out_dir(out)
    log = _demo_log(folder, force)
    kwargs: dict[str, Any] = dict(
        steps=steps, precision=precision, faults=names, seed=seed, guarded=not unguarded, log=log
    )
    what = "unguarded (GradScaler + clip_grad_norm_)" if unguarded else "guarded"
    plan = ", ".join(f"{k} @ {v}" for k, v in schedule_for(steps, names).items()) or "none"
    _out.print(f"floatguard demo: tiny GPT, {precision}, {steps} steps, {what}; faults: {plan}")
    lines = EventLines(fmt="bf16" if precision == "bf16" else "fp16")
    with warnings.catch_warnings():  # a log that cannot be written: said below, in one line
        warnings.filterwarnings("ignore", message="floatguard: cannot write events")
        if no_live:
            result = run_demo(on_event=_show(lines), **kwargs)
        else:
            result = _live_demo(lines, **kwargs)
    for line in lines.close():
        _out.print(line.text, style=line.style or None, markup=False, soft_wrap=True)
    if result.log_error is not None:
        why = re.sub(r"^\[Errno \d+\] ", "", result.log_error)
        ran = len(result.losses) - 1
        raise _fail(f"cannot write {str(log)!r}: {why}; the run stopped at step {ran}")
    from floatguard.diagnose import diagnose
    from floatguard.events import read_events
    from floatguard.report import render_report

    try:
        index = render_report(log, folder, title=f"floatguard demo ({what})")
        found = diagnose(read_events(log))
    except OSError as e:
        raise _write_failed(e, folder) from None
    _out.print(f"\ntask accuracy (next token, positions 2..): {result.accuracy:.3f}")
    _out.print(f"final loss: {result.final_loss:.4f}; weights finite: {result.finite}")
    if result.died_at is not None:
        _out.print(f"[red]the run died at step {result.died_at}[/red]: loss non-finite from "
                   "then on, a weight out of range", markup=True)  # fmt: skip
    _print_findings(found)
    _out.print(f"report: {index} ({result.seconds:.1f} s of training)")


def _print_findings(found: list[Any]) -> None:
    if not found:
        _out.print("diagnosis: nothing to report")
        return
    _out.print("\n[bold]diagnosis[/bold]", markup=True)
    for f in found:
        # (printable: names from a log may hold ESC sequences; they are shown, not obeyed)
        title, evidence = printable(f.title, 2000), printable(f.evidence, 2000)
        _out.print(f"- [bold]{escape(title)}[/bold]: {escape(evidence)}", markup=True)
        _out.print(f"  cause: {escape(printable(f.cause, 2000))}", markup=True)
        _out.print(f"  fix: {escape(printable(f.fix, 2000))}", markup=True)


def _read_runs(runs: list[Path]) -> tuple[Any, list[str]]:
    """The logs as one :class:`~floatguard.runlog.RunLog` (streamed; a progress bar on a
    terminal for a long read) and the lines that could not be read."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from floatguard.runlog import RunLog

    for run in runs:
        if run.is_dir():
            raise _fail(f"{str(run)!r} is a folder; give the run's events.jsonl in it")
        if not run.exists():
            raise _fail(f"{str(run)!r}: no such file (give a run's events.jsonl)")
        if not run.is_file():
            raise _fail(f"{str(run)!r} is not a regular file; give a run's events.jsonl")
    problems: list[str] = []
    total = sum(run.stat().st_size for run in runs)
    show = _err.is_terminal and total > 16 << 20
    bar = Progress(BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=_err,
                   transient=True, disable=not show)  # fmt: skip
    task = bar.add_task("reading", total=total)
    try:
        with bar:
            log = RunLog.read(
                list(runs), problems, lambda done, _t: bar.update(task, completed=done)
            )
    except OSError as e:
        raise _fail(f"{str(e.filename or runs[0])!r}: cannot read it ({e.strerror or e})") from None
    if not len(log) and not log.counts:
        names = ", ".join(repr(str(r)) for r in runs)
        raise _fail(f"{names} holds no readable event" + (f": {problems[0]}" if problems else ""))
    return log, problems


@app.command()
def report(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="A run's event log (events.jsonl); for a multi-rank run, one log per "
            "rank, or one merged log.",
        ),
    ],
    out: Annotated[
        str, typer.Option(help="Folder for index.html and the plots.")
    ] = "floatguard-report",
) -> None:
    """Render a run's event log(s) into the report: index.html and PNG plots."""
    from floatguard.report import render_report

    folder = _out_dir(out, "--out")
    log, problems = _read_runs(list(runs))
    try:
        origin = ", ".join(str(r) for r in runs)
        index = render_report(log, folder, origin=origin, problems=problems, inputs=runs)
    except ValueError as e:
        raise _fail(str(e)) from None
    except OSError as e:
        raise _write_failed(e, folder) from None
    for p in problems:
        _err.print(f"[yellow]skipped[/yellow] {escape(printable(p, 2000))}", markup=True)
    _out.print(f"report: {index}")


@app.command(name="diagnose")
def diagnose_cmd(
    runs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="A run's event log (events.jsonl); for a multi-rank run, one log per "
            "rank, or one merged log (diagnosed as the ranks' agreed view).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    rule: Annotated[
        list[str] | None,
        typer.Option("--rule", help="Only the findings of this id (repeatable; see --list-rules)."),
    ] = None,
    list_rules: Annotated[
        bool, typer.Option("--list-rules", help="Print every rule: id, lesson, fix.")
    ] = False,
) -> None:
    """Print the diagnosis of a run: findings with evidence, likely cause and fix."""
    from floatguard.diagnose import diagnose
    from floatguard.diagnose.specs import SPECS

    unknown = [r for r in rule or [] if r not in SPECS]
    if unknown:
        raise _fail(
            f"--rule {unknown[0]!r} is no rule's id; floatguard diagnose --list-rules lists them"
        )
    if list_rules:
        _print_rules(list(SPECS.values()), as_json)
        return
    if not runs:
        raise _fail("give a run's events.jsonl (or --list-rules)")
    log, problems = _read_runs(list(runs))
    found = diagnose(log, problems)  # the lines not read: counted and named there
    if rule:
        found = [f for f in found if f.rule in rule]
    if as_json:
        print(json.dumps([f.to_dict() for f in found], allow_nan=False))
        return
    _print_findings(found)


def _print_rules(specs: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([dataclasses.asdict(s) for s in specs]))
        return
    for s in specs:
        _out.print(f"[bold]{escape(s.id)}[/bold] (severity {s.severity}): {escape(s.title)}",
                   markup=True)  # fmt: skip
        _out.print(f"  lesson: {escape(s.lesson)}", markup=True)
        _out.print(f"  fix: {escape(s.fix)}", markup=True)


@app.command(name="repro")
def repro_cmd(
    bundle: Annotated[
        Path, typer.Argument(help="A repro bundle (repro-step<N>-<key>.fgr) the guard wrote.")
    ],
    device: Annotated[
        str, typer.Option("--device", help="Where to re-run it: cpu (default), cuda, cuda:1.")
    ] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    script: Annotated[
        Path | None,
        typer.Option(
            "--script",
            help="Write a standalone PyTorch script there (and its tensors beside it, "
            "as .pt) instead of re-running.",
        ),
    ] = None,
) -> None:
    """Re-run a bad step's birth from its repro bundle: reproduced or not, where, the op,
    the line, the values. Exit 0 either way; 2 for a bundle that cannot be read."""
    from floatguard.repro.bundle import ReproError, load_bundle, reproduce

    try:
        loaded = load_bundle(bundle)
    except ReproError as e:
        raise _fail(str(e)) from None
    if script is not None:
        from floatguard.repro.script import write_script

        if script.suffix == ".pt":
            raise _fail(f"--script {script}: name the script (repro.py); its tensors go beside it")
        try:
            py, data = write_script(loaded, script)
        except ReproError as e:
            raise _fail(str(e)) from None
        except OSError as e:
            raise _write_failed(e, script) from None
        if as_json:
            print(json.dumps({"script": str(py), "tensors": str(data)}))
            return
        _out.print(f"script: {escape(str(py))}\ntensors: {escape(str(data))}")
        run = f"python {shlex.quote(str(py))}"
        _out.print(f"run: {escape(run)} \\[device]   (exit 1 when it reproduces)")
        return
    try:
        outcome = reproduce(loaded, device)
    except ReproError as e:
        raise _fail(str(e)) from None
    if as_json:
        print(json.dumps(_json_safe(outcome.to_json()), allow_nan=False))
        return
    _print_outcome(loaded.describe(), outcome)


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def _print_outcome(what: str, o: Any) -> None:
    head = "[red]reproduced[/red]" if o.reproduced else "[green]not reproduced[/green]"
    _out.print(f"{head}: {escape(printable(what, 400))}", markup=True)
    where = "<root>" if o.module == "" else o.module
    _out.print(f"  born in: {escape(printable(str(where), 200))} ({o.phase})")
    _out.print(f"  op:      {escape(printable(str(o.op), 200))}")
    if o.source:
        _out.print(f"  line:    {escape(printable(o.source, 400))}")
    _out.print(f"  re-ran:  {escape(o.ran)} on {escape(o.device)}")
    for role in ("inputs", "output", "value"):
        vals = o.values.get(role)
        for v in vals if isinstance(vals, list) else [vals] if isinstance(vals, dict) else []:
            _out.print(f"  {role}: {escape(printable(_brief_stats(v), 400))}")
    if "threshold" in o.values:
        _out.print(
            f"  value:   {o.values.get('value')!r} (recorded {o.values.get('recorded')!r}, "
            f"bar {o.values.get('threshold')!r})"
        )
    if o.note:
        _out.print(f"  note:    {escape(printable(o.note, 600))}")


def _brief_stats(v: dict[str, Any]) -> str:
    if "nan" not in v:
        return f"{v.get('dtype')}{v.get('shape')}"
    span = (
        f"finite in [{v['min']:.6g}, {v['max']:.6g}]"
        if v.get("min") is not None and v.get("max") is not None
        else "no finite value"
    )
    first = f", first non-finite at {v['first_bad']}" if v.get("first_bad") else ""
    return (
        f"{v.get('dtype')}{v.get('shape')} nan={v['nan']} +inf={v['posinf']} "
        f"-inf={v['neginf']}, {span}{first}"
    )


def _brief(v: object) -> str:
    """What a value is, in a few words: ``int 1``, ``str 'gpt'``, ``tuple (1, 2)``."""
    return f"{type(v).__name__} {printable(repr(v), 60)}"


def _load_target(target: str) -> tuple[Any, list[Any], Any]:
    """(model, batches, loss_fn) of an audit TARGET: a built-in name or module:function.

    Whatever the function does (raises, even SystemExit; returns the wrong thing) is
    one red line naming the target and what it did; Ctrl-C is still Ctrl-C."""
    import importlib

    import torch
    import torch.nn.functional as F

    if target == "tiny-gpt":
        from floatguard.demo import GPT, TINY, synthetic_batch

        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        batches = [synthetic_batch(TINY, 16, generator=gen) for _ in range(4)]

        def lm(model: Any, batch: Any) -> Any:
            return F.cross_entropy(
                model(batch[0]).reshape(-1, TINY.vocab_size), batch[1].reshape(-1)
            )

        return GPT(TINY), batches, lm
    mod_name, sep, fn_name = target.partition(":")
    if not sep or not mod_name or not fn_name:
        raise _fail(f"TARGET {target!r}: give package.module:function or a built-in (tiny-gpt)")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # ImportError, or the module's own code failing on import
        raise _fail(f"TARGET {target!r}: cannot import it ({_what(e)})") from None
    if not callable(fn):
        raise _fail(f"TARGET {target!r} is not a function")
    try:
        got = fn()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the user's function failed (even by sys.exit): one line
        raise _fail(f"TARGET {target!r} raised {_what(e)}") from None
    if not isinstance(got, tuple) or len(got) not in (2, 3):
        raise _fail(
            f"TARGET {target!r} returned {_brief(got)}; it must return (model, batches) "
            "or (model, batches, loss_fn)"
        )
    model, given, loss_fn = got[0], got[1], got[2] if len(got) == 3 else None
    if not isinstance(model, torch.nn.Module):
        raise _fail(f"TARGET {target!r} returned {_brief(model)} as the model; "
                    "give a torch.nn.Module")  # fmt: skip
    if isinstance(given, (str, bytes, torch.Tensor)) or not isinstance(given, Iterable):
        raise _fail(f"TARGET {target!r} returned {_brief(given)} as the batches; give a list "
                    "of batches (a tensor alone: [x])")  # fmt: skip
    try:
        batches = list(given)
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise _fail(f"TARGET {target!r}: reading its batches raised {_what(e)}") from None
    if not batches:
        raise _fail(f"TARGET {target!r} returned no batches; give one at least")
    if loss_fn is not None and not callable(loss_fn):
        raise _fail(f"TARGET {target!r} returned {_brief(loss_fn)} as the loss_fn; "
                    "give a function (model, batch) -> loss, or leave it out")  # fmt: skip
    return model, batches, loss_fn


@app.command(name="audit")
def audit_cmd(
    target: Annotated[
        str,
        typer.Argument(help="package.module:function -> (model, batches[, loss_fn]), or tiny-gpt."),
    ],
    out: Annotated[str, typer.Option(help="Folder for audit.html.")] = "floatguard-audit",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Precision-readiness audit: per layer, what each format and FP8 recipe would lose."""
    from floatguard.audit import audit

    folder = _out_dir(out)
    model, batches, loss_fn = _load_target(target)
    try:
        report = audit(model, batches, loss_fn=loss_fn)
    except (ValueError, TypeError) as e:
        raise _fail(f"TARGET {target!r}: {e}") from None
    except KeyboardInterrupt:
        raise
    except Exception as e:  # most likely the target's model or loss_fn: not our bug to claim
        raise _TargetFailed(
            f"TARGET {target!r}: the audit stopped at {_what(e)} (raised in the model, its "
            "loss_fn or floatguard; rerun with --debug for the traceback)"
        ) from e
    if as_json:
        from floatguard.events import encode_value

        print(json.dumps(encode_value(report.to_dict()), allow_nan=False))
        return
    table = Table(title=f"Precision readiness of {target} (SQNR dB / underflow fraction)")
    keys = ["format:bf16", "format:fp16", "format:e4m3fn", "recipe:e4m3 block 1x128"]
    for col in ("layer", "tensor", "amax", *[k.split(":", 1)[1] for k in keys]):
        table.add_column(col, justify="left" if col in ("layer", "tensor") else "right")
    rows_html = []
    for la in report.layers:
        for kind, res in la.results.items():
            cells = [
                f"{res[k]['sqnr_db']:.1f} / {res[k]['underflow']:.2g}" for k in keys if k in res
            ]
            table.add_row(la.layer, kind, _num(res["amax"]), *cells)
            rows_html.append((la.layer, kind, _num(res["amax"]), cells))
    _out.print(table)
    for la in report.layers:
        _out.print(f"- {escape(la.layer)}: {escape('; '.join(la.recommendation))}", markup=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "audit.html"
        path.write_text(_audit_html(target, keys, rows_html, report), encoding="utf-8")
    except OSError as e:
        raise _write_failed(e, folder) from None
    _out.print(f"audit: {path}")


_ADVISE_RECIPES = ("nvfp4", "nvfp4_training", "mxfp8", "hybrid_tensorwise", "hybrid_rowwise",
                   "hybrid_block", "te_block_scaling", "deepseek_v3", "torchao_rowwise",
                   "torchao_rowwise_with_gw_hp", "deepgemm")  # fmt: skip


@app.command(name="advise")
def advise_cmd(
    target: Annotated[
        str,
        typer.Argument(help="package.module:function -> (model, batches[, loss_fn]), or tiny-gpt."),
    ],
    recipe: Annotated[
        str, typer.Option(help=f"An EmulationRecipe preset: {', '.join(_ADVISE_RECIPES)}.")
    ] = "nvfp4_training",
    budget: Annotated[
        str,
        typer.Option(
            help="Kept in high precision: a fraction of GEMM FLOPs (0.1) or a number of layers (3)."
        ),
    ] = "0.1",
    train_steps: Annotated[
        int,
        typer.Option(
            help="Also train this many steps per seed (AdamW, lr 1e-3) for the expected "
            "loss gap; 0: the one-step loss change."
        ),
    ] = 0,
    seeds: Annotated[int, typer.Option(help="Seeds of the expected gap's training.")] = 3,
    warmup_steps: Annotated[
        int,
        typer.Option(
            help="Measure a copy trained this many high-precision steps first (a fresh "
            "model's sensitivities do not predict training's; 0 for a checkpoint)."
        ),
    ] = 0,
    observed: Annotated[
        float | None,
        typer.Option(help="A loss gap you measured (low precision minus BF16): is it expected?"),
    ] = None,
    log: Annotated[
        Path | None,
        typer.Option(help="Append the advice to this event log (floatguard report shows it)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Which layers to keep in high precision under a recipe, measured on this machine."""
    from floatguard.advise import advise
    from floatguard.emulation import EmulationRecipe

    if recipe not in _ADVISE_RECIPES:
        raise _fail(f"--recipe {recipe!r}: use one of {', '.join(_ADVISE_RECIPES)}")
    try:
        cap: float | int = int(budget.strip())
    except ValueError:
        cap = math.nan
    try:
        cap = float(budget) if math.isnan(cap) else cap
    except ValueError:
        cap = math.nan
    if not ((isinstance(cap, int) and cap >= 0) or 0 < cap < 1):
        raise _fail(
            f"--budget {budget!r}: give a fraction of GEMM FLOPs in (0, 1) (0.1) or a number "
            "of layers (3)"
        )
    if train_steps < 0:
        raise _fail(f"--train-steps {train_steps}: give 0 (no training) or a number of steps")
    if seeds < 1:
        raise _fail(f"--seeds {seeds}: give at least 1")
    if warmup_steps < 0:
        raise _fail(f"--warmup-steps {warmup_steps}: give 0 (a checkpoint) or a number of steps")
    if observed is not None and not math.isfinite(observed):
        raise _fail(f"--observed {observed}: give a finite loss gap (e.g. 0.02)")
    model, batches, loss_fn = _load_target(target)
    try:
        advice = advise(model, batches, getattr(EmulationRecipe, recipe)(), loss_fn=loss_fn,
                        budget=cap, train_steps=train_steps, seeds=seeds, name=recipe,
                        warmup_steps=warmup_steps)  # fmt: skip
    except (ValueError, TypeError) as e:
        raise _fail(f"TARGET {target!r}: {e}") from None
    except KeyboardInterrupt:
        raise
    except Exception as e:
        raise _TargetFailed(
            f"TARGET {target!r}: advise stopped at {_what(e)} (raised in the model, its "
            "loss_fn or floatguard; rerun with --debug for the traceback)"
        ) from e
    if log is not None:
        try:
            advice.log(log)
        except (OSError, ValueError) as e:
            raise _fail(
                f"--log {str(log)!r}: cannot append to it ({e}); give a writable file"
            ) from None
    judged = None if observed is None or advice.expected is None else advice.expected
    plan = advice.expected_plan
    if as_json:
        from floatguard.events import encode_value

        data = advice.to_dict()
        if judged is not None and observed is not None:
            data["observed"] = {"gap": observed, "expected": judged.is_expected(observed),
                                "judgment": judged.judge(observed),
                                "judgment_with_the_plan": None if plan is None
                                else plan.judge(observed)}  # fmt: skip
        print(json.dumps(encode_value(data), allow_nan=False))
        return
    _out.print(escape(advice.summary()))
    if judged is not None and observed is not None:
        _out.print(escape("against the recipe as given: " + judged.judge(observed)))
        if plan is not None:
            _out.print(escape("against the plan: " + plan.judge(observed)))


def _audit_html(target: str, keys: list[str], rows: list[Any], report: Any) -> str:
    import html

    e = html.escape
    head = "".join(f"<th>{e(k.split(':', 1)[1])}</th>" for k in keys)
    body = "".join(
        f"<tr><td>{e(a)}</td><td>{e(b)}</td><td>{e(c)}</td>"
        + "".join(f"<td>{e(x)}</td>" for x in cells) + "</tr>"
        for a, b, c, cells in rows
    )  # fmt: skip
    recs = "".join(
        f"<li><code>{e(la.layer)}</code>: {e('; '.join(la.recommendation))}</li>"
        for la in report.layers
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>floatguard audit</title>"
        "<style>body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto}"
        "td,th{border:1px solid #ddd;padding:.25em .5em}table{border-collapse:collapse}"
        "</style></head><body>"
        f"<h1>Precision readiness: {e(target)}</h1><p>SQNR (dB) / fraction of non-zero "
        "values flushed to zero, unscaled casts and the 1x128 FP8 recipe</p>"
        f"<table><tr><th>layer</th><th>tensor</th><th>amax</th>{head}</tr>{body}</table>"
        f"<h2>Recommendations</h2><ul>{recs}</ul></body></html>"
    )


def _usage_errors() -> tuple[type[Exception], ...]:
    """The class of click's usage errors, by a public name: typer >= 0.26 vendors click
    and derives them from ``typer.TyperException``; older typer runs on click itself."""
    base = getattr(typer, "TyperException", None)
    if base is None:
        import click

        base = click.ClickException
    return (base,)


def _usage_error(e: Exception) -> int:
    """One red line for click's usage error ``e``; its exit code (2)."""
    code = getattr(e, "exit_code", 2)
    format_message = getattr(e, "format_message", None)
    message = (format_message() if callable(format_message) else str(e)).strip()
    if not message or message.startswith("Usage:"):
        # no command: the help is the answer; rich printed it already, plain click did not
        if message:
            _err.print(message, markup=False, highlight=False)
        return int(code)
    option = getattr(e, "option_name", None)
    if isinstance(option, str) and option and hasattr(e, "possibilities"):  # NoSuchOption
        close = sorted(getattr(e, "possibilities", None) or [])
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return _fail(f"no such option: {option}{hint}; see --help", code).exit_code
    first = message.splitlines()[-1].rstrip(".")
    return _fail(f"{first}; see --help", code).exit_code


def _internal_error(e: BaseException) -> int:
    _err.print(
        f"[red]internal error:[/red] {escape(_what(e))}: this is a bug in floatguard; rerun "
        f"with --debug (or {_DEBUG_ENV}=1) for the traceback",
        markup=True,
    )
    return 1


def _split_debug(args: list[str]) -> tuple[list[str], bool]:
    """(the arguments without ``--debug``, whether to show tracebacks): ``--debug``
    anywhere before a ``--``, or FLOATGUARD_DEBUG set to anything but 0."""
    end = args.index("--") if "--" in args else len(args)
    debug = "--debug" in args[:end] or os.environ.get(_DEBUG_ENV, "0") not in ("", "0")
    return [a for i, a in enumerate(args) if a != "--debug" or i >= end], debug


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: a user mistake is one red line and exit code 2, an
    internal error one line and exit code 1 (``--debug``: its traceback), Ctrl-C 130."""
    args, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        rc = app(args, prog_name="floatguard", standalone_mode=False)
    except typer.Exit as e:  # before RuntimeError: typer >= 0.26's Exit is one
        rc = e.exit_code
    except typer.Abort as e:  # older click turns Ctrl-C into Abort
        rc = 130 if isinstance(e.__context__, KeyboardInterrupt) else _fail("aborted").exit_code
    except _TargetFailed as e:
        if debug:
            raise
        rc = _fail(str(e)).exit_code
    except _usage_errors() as e:
        rc = _usage_error(e)
    except KeyboardInterrupt:
        rc = 130
    except OSError as e:  # a disk error no command caught: still the user's to fix
        if debug:
            raise
        disk = e.errno in _DISK_ERRNOS
        rc = _write_failed(e, Path(".")).exit_code if disk else _internal_error(e)
    except Exception as e:
        if debug:
            raise
        rc = _internal_error(e)
    if rc == 130:  # typer >= 0.26 answers Ctrl-C with Exit(130), silently
        _err.print("interrupted")
    raise SystemExit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
