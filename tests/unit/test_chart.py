"""Charts: the history laid onto columns sums (never samples) buckets, the y scale is a round
number above the peak, and knob changes are marked on the axis."""

from __future__ import annotations

from kvdeck.console.widgets.chart import columns, nice_top, plot
from kvdeck.runtime.stats.figures import Bucket


def history(n: int, gap_at: int | None = None, knob_at: int | None = None) -> list[Bucket]:
    out = []
    for i in range(n):
        if i == gap_at:
            continue  # an idle second: no bucket
        out.append(Bucket(float(i), steps=2, busy_s=0.05, arrivals=i % 3, prefill_tokens=100,
                          knob_change=i == knob_at))
    return out


def test_columns_sum_buckets_and_keep_gaps() -> None:
    h = history(100, gap_at=50, knob_at=73)
    cols = columns(h, 1.0, width=25)
    assert len(cols.groups) == 25 and cols.column_s == 4.0
    assert sum(len(g) for g in cols.groups) == 99  # every bucket lands in one column
    rates = cols.series(lambda g, s: sum(b.arrivals for b in g) / s)
    assert sum(r * cols.column_s for r in rates) == sum(b.arrivals for b in h)
    assert len(cols.groups[12]) == 3  # the idle second leaves its column short
    assert cols.marks == {18}  # bucket 73 is in column 73 // 4
    assert cols.start == 0.0


def test_a_short_history_takes_one_column_per_bucket() -> None:
    cols = columns(history(7), 1.0, width=80)
    assert len(cols.groups) == 7 and cols.column_s == 1.0


def test_nice_top() -> None:
    assert [nice_top(x) for x in (0, 0.3, 1, 7, 11, 230, 5000)] == \
        [1.0, 0.5, 1, 10, 20, 500, 5000]


def test_plot_scales_marks_and_labels_time() -> None:
    rows = plot([0.0, 5.0, 10.0, None], {2}, height=4, start=60.0, column_s=30.0)
    text = [r.plain for r in rows]
    assert len(text) == 6  # 4 bar rows, the axis, the time labels
    assert text[0].startswith("    10 ┤") and text[3].startswith("     0 ┤")
    assert text[2].startswith("     5 ┤")  # the middle row's top edge
    bars = [t[8:] for t in text[:4]]
    assert [b[2] for b in bars] == ["█"] * 4  # the peak fills its column
    assert [b[1] for b in bars] == [" ", " ", "█", "█"]  # half of it fills two rows of four
    assert all(b[0] == " " and b[3] == " " for b in bars)  # zero and no data draw nothing
    assert text[4].endswith("──▲─")
    assert text[5].split() == ["1:00", "3:00"]
    stretched = plot([1.0, 2.0], {1}, height=2, start=0, column_s=1, repeat=3)
    assert stretched[2].plain.endswith("───▲▲▲")
