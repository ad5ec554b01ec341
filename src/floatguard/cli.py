"""The ``floatguard`` command line: ``formats`` and ``explain``."""

from __future__ import annotations

import json
import math
from typing import Annotated

import typer
from rich.console import Console
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
        _out.print_json(json.dumps([f.summary() for f in FORMATS.values()]))
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


@app.command(name="explain")
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
        _out.print_json(json.dumps([r.to_dict() for r in results], default=str))
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


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
