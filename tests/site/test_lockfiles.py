"""The lockfiles install exactly what was reviewed: every pin carries the hashes of its files,
none names a folder or index of one machine, every direct dependency is pinned, and a pin that
a published advisory names fails the advisory check (``make audit``, part of ``make test``)."""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from tests.harness import advisories
from tests.harness.procs import REPO_ROOT, free_port

LOCKFILES = {"requirements.txt": "requirements.in", "requirements-dev.txt": "requirements-dev.in"}
ENTRY = re.compile(r"^([a-z0-9][a-z0-9._-]*)==(\S+)( \\)?$")
HASH = re.compile(r"^    --hash=sha256:[0-9a-f]{64}( \\)?$")

# CVE-2023-31047 as the PyPA advisory database publishes it (PYSEC-2023-61), its versions list
# cut short: Django's validation of several files uploaded in one form field.
DJANGO_UPLOADS: dict[str, Any] = {
    "id": "PYSEC-2023-61",
    "aliases": ["CVE-2023-31047"],
    "affected": [
        {
            "package": {"name": "django", "ecosystem": "PyPI", "purl": "pkg:pypi/django"},
            "ranges": [
                {
                    "type": "ECOSYSTEM",
                    "events": [
                        {"introduced": "3.2"},
                        {"fixed": "3.2.19"},
                        {"introduced": "4.0"},
                        {"fixed": "4.1.9"},
                        {"introduced": "4.2"},
                        {"fixed": "4.2.1"},
                    ],
                }
            ],
            "versions": ["3.2", "4.1.8", "4.2", "4.2rc1"],
        }
    ],
}


def lines(lockfile: str) -> list[str]:
    """The lockfile's lines but its comments."""
    text = (REPO_ROOT / lockfile).read_text()
    return [line for line in text.splitlines() if line.strip() and line.lstrip()[0] != "#"]


def entries(lockfile: str) -> dict[str, list[str]]:
    """name -> the hashes pinned for it."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines(lockfile):
        if match := ENTRY.match(line):
            current = found.setdefault(match.group(1), [])
        elif HASH.match(line):
            current.append(line.split("sha256:")[1][:64])
    return found


@pytest.mark.parametrize("lockfile", sorted(LOCKFILES))
def test_every_pin_carries_the_hashes_of_its_files(lockfile: str) -> None:
    """What pip may install is the files of these hashes: another file of the same name and
    version (changed on the index, or another build found elsewhere) is refused."""
    pinned = entries(lockfile)
    assert len(pinned) > 20
    assert [name for name, hashes in pinned.items() if not hashes] == []


@pytest.mark.parametrize("lockfile", sorted(LOCKFILES))
def test_no_lockfile_names_a_folder_or_an_index_of_one_machine(lockfile: str) -> None:
    """Nor any other option: a lockfile is its pins and their hashes (an index or a folder to
    look in is the installing machine's own configuration)."""
    options = [line for line in lines(lockfile) if not (ENTRY.match(line) or HASH.match(line))]
    assert options == []


@pytest.mark.parametrize(("lockfile", "source"), sorted(LOCKFILES.items()))
def test_every_direct_dependency_is_pinned_in_its_lockfile(lockfile: str, source: str) -> None:
    direct = set()
    for line in (REPO_ROOT / source).read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement and not requirement.startswith("-"):
            name = re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0]
            direct.add(advisories.normalize(name))
    pinned = {advisories.normalize(name) for name in entries(lockfile)}
    assert direct and direct - pinned == set()


# --------------------------------------------------------------------------- the advisory check


def lockfile(folder: Path, *pins: str) -> Path:
    path = folder / "requirements.txt"
    path.write_text("".join(f"{pin} \\\n    --hash=sha256:{'0' * 64}\n" for pin in pins))
    return path


def audit(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "tests.harness.advisories", *args]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, check=False)


def folder_of(tmp_path: Path, *records: dict[str, Any]) -> Path:
    folder = tmp_path / "advisories"
    (folder / "vulns").mkdir(parents=True)
    for record in records:
        (folder / "vulns" / f"{record['id']}.json").write_text(json.dumps(record))
    return folder


def test_a_pin_a_published_advisory_names_fails_the_check_with_the_advisory_and_its_fix(
    tmp_path: Path,
) -> None:
    other = {**DJANGO_UPLOADS, "id": "PYSEC-0000-1", "aliases": []}
    other["affected"] = [{**DJANGO_UPLOADS["affected"][0], "package": {"name": "flask"}}]
    withdrawn = {**DJANGO_UPLOADS, "id": "PYSEC-0000-2", "withdrawn": "2023-06-01T00:00:00Z"}
    source = folder_of(tmp_path, DJANGO_UPLOADS, other, withdrawn)
    old = lockfile(tmp_path, "django==4.2.0", "flask==3.0.0")

    done = audit("--advisories", str(source), str(old))
    assert done.returncode == 1, done
    assert done.stdout.splitlines() == [
        f"{old}: django==4.2.0 is affected by PYSEC-2023-61 (CVE-2023-31047); "
        "fixed in 3.2.19, 4.1.9, 4.2.1",
        f"1 known vulnerabilities in the pins of {old} (the advisories in {source})",
    ]

    fixed = lockfile(tmp_path, "Django==4.2.1", "flask==3.0.0")
    done = audit("--advisories", str(source), str(fixed))
    assert done.returncode == 0, done
    assert "2 pins" in done.stdout and "no known vulnerability" in done.stdout


def test_osvs_export_of_pypi_is_read_as_a_zip(tmp_path: Path) -> None:
    export = tmp_path / "all.zip"
    with zipfile.ZipFile(export, "w") as archive:
        archive.writestr("PYSEC-2023-61.json", json.dumps(DJANGO_UPLOADS))
    done = audit("--advisories", str(export), str(lockfile(tmp_path, "django==4.1.8")))
    assert done.returncode == 1 and "PYSEC-2023-61" in done.stdout, done


def test_an_advisory_source_that_cannot_be_read_is_an_error_not_a_pass(tmp_path: Path) -> None:
    (tmp_path / "broken.zip").write_bytes(b"not a zip")
    done = audit("--advisories", str(tmp_path / "broken.zip"), str(lockfile(tmp_path, "a==1")))
    assert done.returncode == 2 and "cannot read the advisories" in done.stderr, done


@pytest.mark.parametrize(
    ("version", "events", "affected"),
    [
        ("4.2.0", [{"introduced": "4.2"}, {"fixed": "4.2.1"}], True),
        ("4.2.1", [{"introduced": "4.2"}, {"fixed": "4.2.1"}], False),
        ("4.1.9", [{"introduced": "0"}, {"fixed": "4.1.9"}, {"introduced": "4.2"}], False),
        ("4.2.5", [{"introduced": "0"}, {"fixed": "4.1.9"}, {"introduced": "4.2"}], True),
        ("1.0", [{"introduced": "0"}, {"fixed": "4.1.9"}], True),
        ("2.0", [{"introduced": "1.0"}, {"last_affected": "2.0"}], True),
        ("2.0.1", [{"introduced": "1.0"}, {"last_affected": "2.0"}], False),
        ("0.9", [{"introduced": "1.0"}, {"last_affected": "2.0"}], False),
        ("5.0rc1", [{"introduced": "4.2"}, {"fixed": "5.0"}], True),
    ],
)
def test_an_osv_range_affects_what_its_events_say(
    version: str, events: list[dict[str, str]], affected: bool
) -> None:
    assert advisories.in_range(Version(version), events) is affected


# --------------------------------------------------------------------------- where it comes from


@pytest.fixture
def export_server(tmp_path: Path) -> Iterator[str]:
    """OSV's export of one record, served on loopback the way OSV serves its own."""
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "all.zip", "w") as archive:
        archive.writestr("PYSEC-2023-61.json", json.dumps(DJANGO_UPLOADS))

    class Files(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/all.zip"
    finally:
        server.shutdown()
        server.server_close()


def test_osvs_export_is_downloaded_once_and_then_kept_when_it_cannot_be_reached(
    tmp_path: Path,
    export_server: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = tmp_path / "var" / "advisories" / "all.zip"
    monkeypatch.setattr(advisories, "CACHE", cache)
    monkeypatch.delenv("LLMGW_ADVISORIES", raising=False)
    old = str(lockfile(tmp_path, "django==4.2.0"))
    monkeypatch.setenv("LLMGW_ADVISORIES_URL", export_server)
    assert advisories.main([old]) == 1
    assert "PYSEC-2023-61" in (out := capsys.readouterr().out) and "just downloaded" in out
    assert cache.exists()

    # A day later OSV cannot be reached: the copy kept is used, and its age said.
    monkeypatch.setenv("LLMGW_ADVISORIES_URL", f"http://127.0.0.1:{free_port()}/all.zip")
    day_ago = cache.stat().st_mtime - advisories.CACHE_HOURS * 3600
    os.utime(cache, (day_ago, day_ago))
    assert advisories.main([old]) == 1
    out = capsys.readouterr().out
    assert "PYSEC-2023-61" in out and "downloaded 24 h ago" in out and "failed now" in out
    # Without any copy the pins are not checked, and that is said where nobody can miss it.
    cache.unlink()
    assert advisories.main([old]) == 0
    assert "were NOT checked against advisories" in capsys.readouterr().err
