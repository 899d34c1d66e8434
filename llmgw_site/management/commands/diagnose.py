"""``manage.py diagnose``: the admin's diagnostics from a shell on this host, asked of every
llmgw process's channel directly (``telemetry.diagnostics``): no web process, store or token
needed, so it answers while the web tier or the store is down.

    manage.py diagnose                          every process: memory, threads, lag, connections
    manage.py diagnose stacks                   every thread's and task's stack, now
    manage.py diagnose profile --seconds 10     the hottest frames; --output f.svg (flame graph)
                                                or f.folded (speedscope, flamegraph.pl)
    manage.py diagnose heap start|report|rebase|stop
    manage.py diagnose objects                  objects by type, GC statistics

``--pid`` (repeatable) narrows it to those processes; ``--json`` prints the answers as they came.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmgw_site.diagnostics.process import folder
from telemetry import diagnostics, profiler, reports

WHAT = ("processes", "stacks", "profile", "heap", "objects")
HEAP_ACTIONS = ("report", "start", "stop", "rebase")


class Command(BaseCommand):
    help = "Look inside every llmgw process on this host: stacks, CPU profile, heap, objects."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("what", nargs="?", choices=WHAT, default="processes")
        parser.add_argument("action", nargs="?", choices=HEAP_ACTIONS, default="report")
        parser.add_argument("--pid", type=int, action="append", default=[])
        parser.add_argument("--seconds", type=float, default=5.0, help="profile length")
        parser.add_argument("--mode", choices=profiler.MODES, default="cpu")
        parser.add_argument("--hz", type=float, default=profiler.DEFAULT_HZ)
        parser.add_argument("--frames", type=int, default=10, help="tracemalloc's depth")
        parser.add_argument("--top", type=int, default=0, help="how many rows (0: the default)")
        parser.add_argument(
            "--output", type=Path, help="write the profile here: .svg, else folded stacks"
        )
        parser.add_argument("--json", action="store_true", help="the answers as JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.LLMGW_DIAGNOSTICS:
            raise CommandError("diagnostics are off (LLMGW_DIAGNOSTICS=false)")
        what: str = options["what"]
        if options["action"] != "report" and what != "heap":
            raise CommandError(f"{options['action']!r} goes with `heap` only")
        if what == "profile" and not 0 < options["seconds"] <= diagnostics.MAX_PROFILE_S:
            raise CommandError(f"--seconds must be above 0, at most {diagnostics.MAX_PROFILE_S:g}")
        op, request = self.request(what, options)
        answers = diagnostics.gather(folder(), op, request, pids=options["pid"])
        if options["json"]:
            self.stdout.write(json.dumps(answers, indent=2, default=str))
            return
        if not answers:
            raise CommandError(f"no llmgw process answers on this host (in {folder()})")
        self.stdout.write(self.render(what, options, answers), ending="")

    def request(self, what: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        top = {"top": options["top"]} if options["top"] > 0 else {}
        if what == "processes":
            return "info", {}
        if what == "profile":
            args = {"seconds": options["seconds"], "hz": options["hz"], "mode": options["mode"]}
            return "profile", args
        if what == "heap":
            return "heap", {"action": options["action"], "frames": options["frames"], **top}
        return what, top

    def render(self, what: str, options: dict[str, Any], answers: list[dict[str, Any]]) -> str:
        if what == "processes":
            return reports.processes(answers)
        if what == "stacks":
            return reports.stacks(answers)
        if what == "objects":
            return reports.objects(answers)
        if what == "heap":
            if options["action"] != "report":
                done = [reports.heading(a) for a in answers if "answer" in a]
                return f"tracemalloc {options['action']}: " + "; ".join(done) + "\n"
            return reports.heap(answers)
        folded = reports.merged_profile(answers)
        output: Path | None = options["output"]
        text = reports.profile(folded, answers, top=options["top"] or 25)
        if output is not None:
            if output.suffix == ".svg":
                svg = reports.flame_graph(answers, mode=options["mode"], seconds=options["seconds"])
                output.write_text(svg)
            else:
                output.write_text(profiler.folded_text(folded))
            text += f"\nwritten to {output}\n"
        return text
