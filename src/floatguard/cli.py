"""The ``floatguard`` command line: ``demo``, ``report``, ``diagnose``, ``formats``, ``explain``.

User mistakes (a bad option, a missing file, an unwritable folder, an unknown
command) are one red line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

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


def _fail(message: str) -> typer.Exit:
    """Report a user mistake as one red line; the caller raises the returned Exit(2)."""
    _err.print(f"[red]error:[/red] {message}", markup=True)
    return typer.Exit(code=2)


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


@app.command(name="explain", context_settings={"ignore_unknown_options": True})
def explain_cmd(
    value: Annotated[str, typer.Argument(help="A number: 0.1, 1e-8, 0x1.cp8, inf, nan.")],
    fmt: Annotated[
        str,
        typer.Option("--format", "-f", help="Comma-separated formats, e.g. fp32,bf16,fp16,e4m3fn."),
    ] = "fp32,bf16,fp16,e4m3fn",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Explain how VALUE is stored in each format: bits, class, error, neighbours."""
    try:
        v = parse_value(value)
        names = [n for n in (s.strip() for s in fmt.split(",")) if n]
        if not names:
            raise ValueError("--format is empty; give e.g. --format fp32,bf16")
        results = [explain(v, get(n)) for n in names]
    except (ValueError, TypeError) as e:
        raise _fail(str(e)) from None
    if as_json:
        # strict JSON: non-finite floats tagged as the event stream writes them
        from floatguard.events import encode_value

        print(json.dumps(encode_value([r.to_dict() for r in results]), default=str))
        return
    # Formats side by side: one column each, one row per property.
    table = Table(title=f"{value} stored in {', '.join(r.format for r in results)}")
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


def _live_demo(**kwargs: Any) -> Any:
    """Run the demo with a rich progress bar; events print above it as they happen."""
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

    def on_event(ev: Any) -> None:
        if ev.kind in ("step", "snapshot"):
            if ev.kind != "step" or ev["action"] == "applied":
                return
            progress.console.print(
                f"step {ev.step}: [yellow]{ev['action']}[/yellow] ({ev['reason']})", markup=True
            )
            return
        text = ", ".join(f"{k}={v}" for k, v in ev.fields.items() if v is not None)
        progress.console.print(f"step {ev.step}: [red]{ev.kind}[/red] {escape(text)}", markup=True)

    with progress:
        return run_demo(on_step=on_step, on_event=on_event, **kwargs)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="Training steps (>= 20).")] = 400,
    precision: Annotated[
        str, typer.Option(help="fp16 (with loss scaling), bf16 or fp32.")
    ] = "fp16",
    faults: Annotated[
        str, typer.Option(help="default, none, or names: corrupt_batch,bit_flip,masked_row,...")
    ] = "default",
    seed: Annotated[int, typer.Option(help="Seed of the model, the data and the schedule.")] = 0,
    out: Annotated[Path, typer.Option(help="Folder for the report.")] = Path("floatguard-demo"),
    unguarded: Annotated[
        bool, typer.Option("--unguarded", help="The same schedule without the guard.")
    ] = False,
    no_live: Annotated[bool, typer.Option("--no-live", help="Log lines, no live view.")] = False,
) -> None:
    """Train a tiny GPT under fp16 with a fault schedule; find, localize and answer each fault."""
    from floatguard.demo.run import FAULTS, run_demo, schedule_for

    if precision not in ("fp16", "bf16", "fp32"):
        raise _fail(f"--precision {precision!r}; use fp16, bf16 or fp32")
    if steps < 20:
        raise _fail(f"--steps {steps}: the fault schedule needs at least 20 steps")
    names = {"default": list(FAULTS), "none": []}.get(faults)
    if names is None:
        names = [f.strip() for f in faults.split(",") if f.strip()]
        unknown = [f for f in names if f not in FAULTS]
        if unknown:
            raise _fail(f"--faults: unknown fault {unknown[0]!r}; known: {', '.join(FAULTS)}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        log = out / "events.jsonl"
        log.unlink(missing_ok=True)
        probe = out / ".floatguard-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise _fail(f"--out {str(out)!r} is not a writable folder ({e.strerror or e})") from None
    kwargs: dict[str, Any] = dict(
        steps=steps, precision=precision, faults=names, seed=seed, guarded=not unguarded, log=log
    )
    what = "unguarded (GradScaler + clip_grad_norm_)" if unguarded else "guarded"
    plan = ", ".join(f"{k} @ {v}" for k, v in schedule_for(steps, names).items()) or "none"
    _out.print(f"floatguard demo: tiny GPT, {precision}, {steps} steps, {what}; faults: {plan}")
    result = run_demo(**kwargs) if no_live else _live_demo(**kwargs)
    from floatguard.diagnose import diagnose
    from floatguard.events import read_events
    from floatguard.report import render_report

    index = render_report(log, out, title=f"floatguard demo ({what})")
    found = diagnose(read_events(log))
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
        _out.print(f"- [bold]{escape(f.title)}[/bold]: {escape(f.evidence)}", markup=True)
        _out.print(f"  cause: {escape(f.cause)}", markup=True)
        _out.print(f"  fix: {escape(f.fix)}", markup=True)


def _events_of(run: Path) -> tuple[list[Any], list[str]]:
    from floatguard.events import read_events

    if not run.is_file():
        raise _fail(f"{str(run)!r}: no such file (give a run's events.jsonl)")
    problems: list[str] = []
    try:
        events = list(read_events(run, errors=problems))
    except OSError as e:
        raise _fail(f"{str(run)!r}: cannot read it ({e.strerror or e})") from None
    if not events:
        raise _fail(
            f"{str(run)!r} holds no readable event" + (f": {problems[0]}" if problems else "")
        )
    return events, problems


@app.command()
def report(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="A run's event log (events.jsonl); for a multi-rank run, one log per "
            "rank, or one merged log.",
        ),
    ],
    out: Annotated[Path, typer.Option(help="Folder for index.html and the plots.")] = Path(
        "floatguard-report"
    ),
) -> None:
    """Render a run's event log(s) into the report: index.html and PNG plots."""
    from floatguard.report import render_report

    problems = [p for run in runs for p in _events_of(run)[1]]
    try:
        index = render_report(list(runs), out)
    except OSError as e:
        raise _fail(f"--out {str(out)!r} is not a writable folder ({e.strerror or e})") from None
    for p in problems:
        _err.print(f"[yellow]skipped[/yellow] {escape(p)}", markup=True)
    _out.print(f"report: {index}")


@app.command(name="diagnose")
def diagnose_cmd(
    run: Annotated[Path, typer.Argument(help="A run's event log (events.jsonl).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the diagnosis of a run: findings with evidence, likely cause and fix."""
    from floatguard.diagnose import diagnose

    events, problems = _events_of(run)
    found = diagnose(events)
    if as_json:
        print(json.dumps([f.to_dict() for f in found], allow_nan=False))
        return
    for p in problems:
        _err.print(f"[yellow]skipped[/yellow] {escape(p)}", markup=True)
    _print_findings(found)


def _load_target(target: str) -> tuple[Any, list[Any], Any]:
    """(model, batches, loss_fn) of an audit TARGET: a built-in name or module:function."""
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
    except (ImportError, AttributeError) as e:
        raise _fail(f"TARGET {target!r}: cannot import it ({e})") from None
    if not callable(fn):
        raise _fail(f"TARGET {target!r} is not a function")
    try:
        got = fn()
    except Exception as e:  # the user's function failed: say so in one line
        raise _fail(f"TARGET {target!r} raised {type(e).__name__}: {e}") from None
    if not isinstance(got, tuple) or len(got) not in (2, 3):
        raise _fail(f"TARGET {target!r} must return (model, batches) or (model, batches, loss_fn)")
    model, batches = got[0], list(got[1])
    return model, batches, got[2] if len(got) == 3 else None


@app.command(name="audit")
def audit_cmd(
    target: Annotated[
        str,
        typer.Argument(help="package.module:function -> (model, batches[, loss_fn]), or tiny-gpt."),
    ],
    out: Annotated[Path, typer.Option(help="Folder for audit.html.")] = Path("floatguard-audit"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Precision-readiness audit: per layer, what each format and FP8 recipe would lose."""
    from floatguard.audit import audit

    model, batches, loss_fn = _load_target(target)
    try:
        report = audit(model, batches, loss_fn=loss_fn)
    except (ValueError, TypeError) as e:
        raise _fail(f"TARGET {target!r}: {e}") from None
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
        out.mkdir(parents=True, exist_ok=True)
        path = out / "audit.html"
        path.write_text(_audit_html(target, keys, rows_html, report), encoding="utf-8")
    except OSError as e:
        raise _fail(f"--out {str(out)!r} is not a writable folder ({e.strerror or e})") from None
    _out.print(f"audit: {path}")


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


def _click_exceptions() -> Any:
    import importlib

    try:  # typer >= 0.20 carries its own copy of click
        return importlib.import_module("typer._click.exceptions")
    except ImportError:  # older typer: click itself
        return importlib.import_module("click.exceptions")


def main() -> None:
    """Console-script entry point: a user mistake is one red line and exit code 2."""
    cx = _click_exceptions()
    try:
        rc = app(standalone_mode=False)
    except cx.NoSuchOption as e:
        rc = _fail(f"no such option: {e.option_name}; see --help").exit_code
    except cx.UsageError as e:
        first = e.format_message().strip().splitlines()[-1].rstrip(".")
        rc = _fail(f"{first}; see --help").exit_code
    except getattr(cx, "Abort", KeyboardInterrupt):
        rc = _fail("aborted").exit_code
    except (typer.Exit, getattr(cx, "Exit", typer.Exit)) as e:
        rc = e.exit_code
    except KeyboardInterrupt:
        rc = _fail("interrupted").exit_code
    raise SystemExit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
