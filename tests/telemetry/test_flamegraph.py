"""The flame graph (``telemetry.flamegraph``) and the folded stacks it is drawn from: each box
as wide as its time, children on top of their caller, names escaped, the narrowest left out;
and the profiles of several processes merged under one root each (``telemetry.profiler``)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from telemetry import flamegraph, profiler

SVG = "{http://www.w3.org/2000/svg}"


def boxes(svg: str) -> dict[str, tuple[float, float, float]]:
    """Each box's name (from its tooltip): (x, y, width)."""
    out: dict[str, tuple[float, float, float]] = {}
    for group in ET.fromstring(svg).iter(f"{SVG}g"):
        title = group.find(f"{SVG}title")
        rect = group.find(f"{SVG}rect")
        assert title is not None and title.text and rect is not None
        name = title.text.split(" — ")[0]
        out[name] = (float(rect.get("x", 0)), float(rect.get("y", 0)), float(rect.get("width", 0)))
    return out


def test_each_box_is_as_wide_as_its_time_and_sits_on_its_caller() -> None:
    folded = {"main;serve;parse": 3000, "main;serve;<send & flush>": 1000, "main;idle": 4000}
    svg = flamegraph.svg(folded, title="t", subtitle="s")
    drawn = boxes(svg)
    assert drawn["all"][2] == flamegraph.WIDTH
    assert drawn["main"][2] == flamegraph.WIDTH
    assert drawn["serve"][2] == flamegraph.WIDTH / 2
    assert drawn["parse"][2] == flamegraph.WIDTH * 3 / 8
    # Children sorted by name, left to right, inside their caller; one row above it.
    assert drawn["<send & flush>"][0] == drawn["serve"][0]
    assert drawn["parse"][0] == drawn["serve"][0] + drawn["<send & flush>"][2]
    assert drawn["serve"][1] == drawn["main"][1] - flamegraph.ROW
    # Names are escaped in the document, and read back as they were.
    assert "<title>&lt;send &amp; flush&gt; — 1.0 ms, 12.50%</title>" in svg
    assert ET.fromstring(svg).find(f"{SVG}text") is not None


def test_a_box_too_narrow_to_see_is_left_out_with_what_it_called() -> None:
    folded = {"main;hot": 1_000_000, "main;rare;deeper": 1}
    drawn = boxes(flamegraph.svg(folded, title="t"))
    assert "hot" in drawn
    assert "rare" not in drawn and "deeper" not in drawn


def test_profiles_of_several_processes_merge_under_a_root_each() -> None:
    merged = profiler.merged([("web 10", {"a;b": 5}), ("worker 11", {"a;b": 7, "c": 1})])
    assert merged == {"web 10;a;b": 5, "worker 11;a;b": 7, "worker 11;c": 1}
    text = profiler.folded_text(merged)
    assert text.splitlines() == ["web 10;a;b 5", "worker 11;a;b 7", "worker 11;c 1"]
    assert re.fullmatch(r"(\S.* \d+\n)+", text)
    hottest = profiler.hottest(merged, 2)
    assert hottest == [("b", 12, 12), ("c", 1, 1)]
