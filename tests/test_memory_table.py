"""The per-stage "fits" column of the memory table says what the verdict under it says.

Before, the column compared each stage's allocated total in GiB floats while ``MemoryEstimate.fits`` judged the peak
stage's reserved peak (torchtitan) in whole KiB, so a row could read "yes" above "does NOT fit". The stages here are
built by hand, not by the estimator: the test is of the judging and the table, with byte counts chosen on either side
of the boundaries.
"""

from __future__ import annotations

import io

from rich.console import Console

from planner.memory import GIB, KIB, MemoryEstimate, StageMemory
from planner.render import memory_table

USABLE_GIB = 0.1  # 107,374,182.4 bytes: 104,857 whole KiB (107,373,568 bytes) of it


def _stage(stage: int, total_bytes: float, reserved_bytes: float | None = None) -> StageMemory:
    return StageMemory(stage=stage, layers=1, weights_bytes=total_bytes, grads_bytes=0.0, optimizer_bytes=0.0,
                       activations_bytes=0.0, other_bytes=0.0, reserved_bytes=reserved_bytes)


def _rows(est: MemoryEstimate) -> list[str]:
    con = Console(file=io.StringIO(), width=200, color_system=None)
    con.print(memory_table(est.to_dict()))
    return [line for line in con.file.getvalue().splitlines() if line.startswith("│")]


def test_the_kib_rule_at_the_boundary():
    whole_kib_bytes = int(USABLE_GIB * GIB // KIB) * KIB
    assert _stage(0, whole_kib_bytes).fits_in(USABLE_GIB)
    assert not _stage(0, whole_kib_bytes + 1).fits_in(USABLE_GIB)
    # within the last fraction of a KiB: a GiB-float comparison passes it, the KiB rule (and the search) refuses it
    near = 107_374_000
    assert near / GIB <= USABLE_GIB
    assert not _stage(0, near).fits_in(USABLE_GIB)


def test_a_stage_row_never_says_yes_under_a_no_verdict():
    near = 107_374_000  # GiB-float: fits; whole KiB: does not
    est = MemoryEstimate(capacity_gib=0.2, usable_gib=USABLE_GIB, stages=(_stage(0, 50e6), _stage(1, near)))
    assert not est.fits
    d = est.to_dict()
    assert [s["fits"] for s in d["stages"]] == [True, False]
    rows = _rows(est)
    assert rows[0].rstrip("│ ").endswith("yes") and rows[1].rstrip("│ ").endswith("NO")


def test_the_reserved_peak_is_what_a_stage_is_judged_by():
    # allocated 60 MB fits 0.1 GiB; the caching allocator's reserved 120 MB does not (torchtitan's replay)
    est = MemoryEstimate(capacity_gib=0.2, usable_gib=USABLE_GIB, stages=(_stage(0, 60e6, reserved_bytes=120e6),))
    assert not est.fits and est.to_dict()["stages"][0]["fits"] is False
    con = Console(file=io.StringIO(), width=200, color_system=None)
    con.print(memory_table(est.to_dict()))
    out = con.file.getvalue()
    assert "reserved" in out
    row = [line for line in out.splitlines() if line.startswith("│")][0]
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[-1] == "NO"
    assert cells[-4] == f"{60e6 / GIB:.2f}" and cells[-3] == f"{120e6 / GIB:.2f}"  # total, reserved
    assert cells[-2] == f"{100 * 120e6 / GIB / USABLE_GIB:.0f}%"  # the share is of the reserved peak


def test_no_reserved_column_where_none_is_modelled():
    est = MemoryEstimate(capacity_gib=0.2, usable_gib=USABLE_GIB, stages=(_stage(0, 60e6),))
    con = Console(file=io.StringIO(), width=200, color_system=None)
    con.print(memory_table(est.to_dict()))
    assert "reserved" not in con.file.getvalue()
