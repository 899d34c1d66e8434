"""A flame graph as one self-contained SVG, drawn from folded stacks (``telemetry.profiler``).

Drawn here rather than handed to speedscope or flamegraph.pl: the admin listener is usually
on a private network whose browsers may not reach speedscope.app, and bundling a JavaScript
viewer (or a Perl script) would be a dependency to keep up. An SVG opens in any browser,
needs no script (each frame's name, time and share are in its tooltip) and can be saved and
mailed as it is. The folded text itself is offered for download too, for those tools.

Each box is a function, as wide as the time spent in it and in what it called; a box's
children sit on top of it, sorted by name, so that two graphs of the same code compare.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

WIDTH = 1200
ROW = 16
TOP = 48  # room for the title and the subtitle
_CHAR = 6.6  # the width of one character at the font size below, near enough
_FONT = 11
_NARROWEST = 0.3  # boxes narrower than this (in pixels) are left out, with what they called


@dataclass
class _Node:
    name: str
    weight: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


def _tree(folded: Mapping[str, int]) -> _Node:
    root = _Node("all")
    for stack, weight in folded.items():
        root.weight += weight
        node = root
        for name in stack.split(";"):
            node = node.children.setdefault(name, _Node(name))
            node.weight += weight
    return root


def _depth(node: _Node) -> int:
    return 1 + max((_depth(child) for child in node.children.values()), default=0)


def _colour(name: str) -> str:
    # The classic flame graph's warm palette, one colour per function, the same in every graph.
    hashed = zlib.crc32(name.encode())
    return f"rgb({205 + hashed % 50},{(hashed >> 8) % 230},{(hashed >> 16) % 55})"


def svg(folded: Mapping[str, int], *, title: str, subtitle: str = "", unit: str = "us") -> str:
    """The flame graph of ``folded`` (weights in ``unit``: ``us`` is shown as milliseconds)."""
    root = _tree(folded)
    depth = _depth(root)
    height = TOP + depth * ROW + 8
    total = max(1, root.weight)
    scale = WIDTH / total
    boxes: list[str] = []

    def draw(node: _Node, x: float, level: int) -> None:
        width = node.weight * scale
        if width < _NARROWEST:
            return
        y = height - 8 - (level + 1) * ROW
        shown = f"{node.weight / 1000:.1f} ms" if unit == "us" else f"{node.weight} {unit}"
        tip = f"{node.name} — {shown}, {node.weight / total:.2%}"
        label = ""
        fits = int(width / _CHAR)
        if fits >= 3:
            text = node.name if len(node.name) <= fits else node.name[: fits - 2] + ".."
            label = f'<text x="{x + 3:.1f}" y="{y + ROW - 4}">{escape(text)}</text>'
        boxes.append(
            f"<g><title>{escape(tip)}</title>"
            f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{ROW - 1}" '
            f'fill="{_colour(node.name)}"/>{label}</g>'
        )
        offset = x
        for name in sorted(node.children):
            child = node.children[name]
            draw(child, offset, level + 1)
            offset += child.weight * scale

    draw(root, 0.0, 0)
    return "\n".join(
        [
            '<?xml version="1.0" encoding="UTF-8"?>',
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}">',
            f"<style>text {{ font-family: monospace; font-size: {_FONT}px; }} "
            "rect { stroke: #fff; stroke-width: 0.5; } g:hover rect { stroke: #000; }</style>",
            '<rect width="100%" height="100%" fill="#fdfcf7"/>',
            f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="15">'
            f"{escape(title)}</text>",
            f'<text x="{WIDTH / 2}" y="36" text-anchor="middle">{escape(subtitle)}</text>',
            *boxes,
            "</svg>",
            "",
        ]
    )
