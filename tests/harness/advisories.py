"""The lockfiles' pins checked against published security advisories (`make audit`, part of
`make test`): a pin that a known vulnerability affects fails the check, naming the advisory and
the versions that fix it.

The advisories are OSV records (https://ossf.github.io/osv-schema/), the format every Python
advisory database publishes in: the OSV export of PyPI (``PyPI/all.zip``, JSON), a checkout of
the PyPA advisory database (YAML), or any folder of such records. Where they come from:

- ``--advisories PATH`` or ``LLMGW_ADVISORIES``: that zip or folder (an error if unreadable);
- otherwise OSV's export, downloaded from ``LLMGW_ADVISORIES_URL`` (default: OSV's) and kept
  for a day under ``var/advisories/``;
- and where neither can be had (a machine that reaches no advisory source), the check says
  loudly that the pins were NOT checked and exits 0: the suite cannot wait on a service the
  machine cannot reach, and says so instead of passing in silence.

Exit status: 0 no pin affected (or not checked, said loudly); 1 pins affected; 2 the given
source or a lockfile cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

OSV_PYPI_EXPORT = "https://osv-vulnerabilities.storage.googleapis.com/PyPI/all.zip"
CACHE = Path(__file__).resolve().parents[2] / "var" / "advisories" / "PyPI-all.zip"
CACHE_HOURS = 24.0
DOWNLOAD_TIMEOUT_S = 60.0
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


class SourceError(Exception):
    """The advisories or a lockfile cannot be read."""


@dataclass(frozen=True)
class Pin:
    lockfile: str
    name: str  # normalized (PEP 503)
    version: str


@dataclass(frozen=True)
class Finding:
    pin: Pin
    advisory: str
    aliases: tuple[str, ...]
    fixed: tuple[str, ...]

    def line(self) -> str:
        pin, also = self.pin, f" ({', '.join(self.aliases)})" if self.aliases else ""
        fix = f"fixed in {', '.join(self.fixed)}" if self.fixed else "no fixed version published"
        return (
            f"{pin.lockfile}: {pin.name}=={pin.version} is affected by {self.advisory}{also}; {fix}"
        )


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(lockfile: Path) -> list[Pin]:
    try:
        text = lockfile.read_text()
    except OSError as exc:
        raise SourceError(f"cannot read {lockfile}: {exc.strerror}") from None
    pins = []
    for line in text.splitlines():
        if match := _PIN.match(line):
            pins.append(Pin(str(lockfile), normalize(match.group(1)), match.group(2)))
    return pins


def records(source: Path) -> Iterator[dict[str, Any]]:
    """Every OSV record in a zip (OSV's export) or a folder tree (JSON or YAML files)."""
    if source.is_file():
        try:
            with zipfile.ZipFile(source) as archive:
                for name in archive.namelist():
                    if name.endswith(".json"):
                        yield json.loads(archive.read(name))
        except (OSError, zipfile.BadZipFile, ValueError) as exc:
            raise SourceError(f"cannot read the advisories in {source}: {exc}") from None
        return
    if not source.is_dir():
        raise SourceError(f"no advisories at {source}: neither an OSV zip nor a folder")
    for path in sorted(source.rglob("*")):
        if path.suffix not in {".json", ".yaml", ".yml"}:
            continue
        try:
            text = path.read_bytes()
            yield json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise SourceError(f"cannot read the advisory {path}: {exc}") from None


def _version(raw: str) -> Version | None:
    try:
        return Version(raw)
    except InvalidVersion:
        return None


def in_range(version: Version, events: list[dict[str, str]]) -> bool:
    """OSV's ECOSYSTEM range: walking its events in version order, ``introduced`` starts an
    affected stretch at that version, ``fixed`` ends it at that version and ``last_affected``
    just after it."""
    marks: list[tuple[Version, bool, bool]] = []  # (at, affected from there, strictly after)
    for event in events:
        for kind, raw in event.items():
            at = _version(str(raw))
            if at is None or kind not in {"introduced", "fixed", "last_affected"}:
                continue
            marks.append((at, kind == "introduced", kind == "last_affected"))
    affected = False
    for at, starts, after in sorted(marks, key=lambda mark: mark[0]):
        if version > at or (version == at and not after):
            affected = starts
    return affected


def affects(record: dict[str, Any], pin: Pin) -> tuple[str, ...] | None:
    """The fixed versions of ``record`` if it affects ``pin`` (an empty tuple when none is
    published), or None if it does not."""
    version = _version(pin.version)
    for affected in record.get("affected") or ():
        package = affected.get("package") or {}
        if package.get("ecosystem") != "PyPI" or normalize(str(package.get("name"))) != pin.name:
            continue
        ranges = [r for r in affected.get("ranges") or () if r.get("type") == "ECOSYSTEM"]
        # Listed versions compare as versions: a record lists "4.2", a lockfile pins "4.2.0".
        listed = [str(v) for v in affected.get("versions") or ()]
        hit = pin.version in listed or (
            version is not None
            and (
                version in {_version(v) for v in listed}
                or any(in_range(version, r.get("events") or []) for r in ranges)
            )
        )
        if hit:
            fixed = {str(e["fixed"]) for r in ranges for e in r.get("events") or () if "fixed" in e}
            return tuple(sorted(fixed, key=lambda v: _version(v) or Version("0")))
    return None


def check(pins: Iterable[Pin], advisories: Iterable[dict[str, Any]]) -> list[Finding]:
    by_name: dict[str, list[Pin]] = {}
    for pin in pins:
        by_name.setdefault(pin.name, []).append(pin)
    findings = []
    for record in advisories:
        if not isinstance(record, dict) or record.get("withdrawn"):
            continue
        names = {
            normalize(str((a.get("package") or {}).get("name")))
            for a in record.get("affected") or ()
        }
        for name in names & by_name.keys():
            for pin in by_name[name]:
                fixed = affects(record, pin)
                if fixed is not None:
                    aliases = tuple(str(a) for a in record.get("aliases") or ())
                    findings.append(Finding(pin, str(record["id"]), aliases, fixed))
    return sorted(findings, key=lambda f: (f.pin.lockfile, f.pin.name, f.advisory))


def download(url: str, cache: Path) -> tuple[Path | None, str]:
    """OSV's export, downloaded at most once a CACHE_HOURS; (where it is, what was done)."""
    fresh = cache.exists() and time.time() - cache.stat().st_mtime < CACHE_HOURS * 3600
    if fresh:
        return cache, f"the advisories downloaded from {url} within {CACHE_HOURS:g} h"
    partial = cache.with_name(cache.name + ".partial")
    try:
        cache.parent.parent.mkdir(mode=0o700, exist_ok=True)
        cache.parent.mkdir(mode=0o700, exist_ok=True)
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as answer:
            partial.write_bytes(answer.read())
        partial.replace(cache)
    except (OSError, urllib.error.URLError) as exc:
        partial.unlink(missing_ok=True)
        if cache.exists():
            age = (time.time() - cache.stat().st_mtime) / 3600
            return cache, f"the advisories downloaded {age:.0f} h ago ({url} failed now: {exc})"
        return None, f"{url} cannot be reached ({exc})"
    return cache, f"the advisories just downloaded from {url}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lockfiles", nargs="+", type=Path)
    parser.add_argument(
        "--advisories",
        type=Path,
        default=os.environ.get("LLMGW_ADVISORIES") or None,
        help="an OSV export (zip) or a folder of OSV records (default: LLMGW_ADVISORIES, "
        "else OSV's export, downloaded)",
    )
    args = parser.parse_args(argv)
    try:
        pins = [pin for lockfile in args.lockfiles for pin in read_pins(lockfile)]
        if args.advisories is not None:
            source: Path | None = args.advisories
            what = f"the advisories in {source}"
        else:
            url = os.environ.get("LLMGW_ADVISORIES_URL") or OSV_PYPI_EXPORT
            source, what = download(url, CACHE)
        if source is None:
            banner = "=" * 78
            print(
                f"{banner}\nWARNING: the lockfiles' pins were NOT checked against advisories: "
                f"{what}.\nSet LLMGW_ADVISORIES to an OSV export of PyPI (all.zip) or a folder "
                f"of OSV records to check them.\n{banner}",
                file=sys.stderr,
            )
            return 0
        findings = check(pins, records(source))
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for finding in findings:
        print(finding.line())
    names = ", ".join(str(lockfile) for lockfile in args.lockfiles)
    if findings:
        print(f"{len(findings)} known vulnerabilities in the pins of {names} ({what})")
        return 1
    print(f"{len(pins)} pins of {names}: no known vulnerability ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
