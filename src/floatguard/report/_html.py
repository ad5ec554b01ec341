"""The page's small pieces shared by its sections: escaping, images, saving a figure."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from floatguard._safe_io import replacing

__all__ = ["escape", "img_tag", "save_figure", "visible"]


def save_figure(fig: Any, plt: Any, path: Path) -> None:
    """Lay out and write a figure; a layout matplotlib cannot compute is drawn as is."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tight_layout's "not compatible" and the like
        try:
            fig.tight_layout()
        except (ValueError, OverflowError):
            pass
        with replacing(path) as tmp:
            fig.savefig(tmp, dpi=90, format=path.suffix.lstrip("."))
    plt.close(fig)


def visible(c: str) -> str:
    """A character as the page shows it: control characters and bidirectional overrides
    (which reorder text on screen) as escapes, everything else as it is."""
    if c.isprintable() and not 0x202A <= ord(c) <= 0x202E and not 0x2066 <= ord(c) <= 0x2069:
        return c
    return repr(c)[1:-1] if c.isascii() else f"\\u{ord(c):04x}"


def escape(v: object) -> str:
    text = str(v)
    if not text.isprintable() or any(0x202A <= ord(c) <= 0x2069 for c in text):
        text = "".join(visible(c) for c in text)
    return html.escape(text, quote=True)


def img_tag(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(alt)}">'
