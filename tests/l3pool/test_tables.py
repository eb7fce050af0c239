"""`l3pool.tables.table`, the one table helper, and the tables built on it staying aligned with
realistic values (a Hugging Face model name, a long namespace id)."""

from __future__ import annotations

from typing import Any

import pytest

from l3pool.tables import table

MODEL = "deepseek-ai/DeepSeek-V3-0324@fp8-tp8"  # longer than the 24 columns purge once gave it


def test_columns_fit_their_widest_cell() -> None:
    lines = table(["name", "n", "note"], [["a", 1, "x"], [MODEL, 12345, "a long free note"]], right={1},
                  free_last=True)  # fmt: skip
    assert lines == [
        "name" + " " * (len(MODEL) - 4) + "      n  note",
        "a" + " " * (len(MODEL) - 1) + "      1  x",
        f"{MODEL}  12345  a long free note",
    ]
    assert table(["a", "b"], [], indent="  ") == ["  a  b"]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        table(["a", "b"], [["x"]])


def _purge_report(dry_run: bool) -> dict[str, Any]:
    row = {"namespace": "ns-" + "f" * 29, "model": MODEL, "tenant": "", "layout": "page_first_direct", "tp": "0/8",
           "objects": 1200, "removed": 1200, "left": 0, "forgotten": True}  # fmt: skip
    short = {**row, "namespace": "ns1", "model": "m", "objects": 7, "removed": 7, "forgotten": False}
    return {"dry_run": dry_run, "force": False, "namespaces": [row, short], "removed": 1207, "failed": []}


@pytest.mark.parametrize("dry_run", [True, False])
def test_purge_table_stays_aligned_with_a_long_model_name(dry_run: bool) -> None:
    from l3pool.tools.purge import render

    head, long_row, short_row, *_ = render(_purge_report(dry_run)).splitlines()
    for col in ("model", "tenant", "layout", "tp"):  # every column starts where its header does
        at = head.index(col)
        assert long_row[at - 2 : at] == "  " and short_row[at - 2 : at] == "  ", (head, long_row, short_row)
    assert long_row.index("page_first_direct") == short_row.index("page_first_direct") == head.index("layout")
    end = head.index("objects") + len("objects")  # numbers right-aligned under their header
    assert long_row[:end].endswith("1200") and short_row[:end].endswith("7")
    if not dry_run:
        assert long_row.endswith("(record forgotten)") and not short_row.endswith(" ")
