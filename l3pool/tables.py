"""Plain-text tables for the commands' human-readable output: one helper, so that every table
sizes its columns to its longest cell (a realistic model name included) the same way."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    right: Collection[int] = (),
    indent: str = "",
    free_last: bool = False,
    gap: str = "  ",
) -> list[str]:
    """The header and the rows as lines, each column as wide as its widest cell (`str()` of it);
    columns whose index is in `right` are right-aligned (numbers); `free_last`: the last column is
    not padded (a free-text note that may be long); trailing spaces are stripped."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    if any(len(r) != len(header) for r in cells):
        raise ValueError(f"every row needs {len(header)} cells")
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    if free_last and widths:
        widths[-1] = 0
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append((indent + gap.join(parts)).rstrip())
    return lines
