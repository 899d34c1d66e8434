"""The operators' manage.py commands: each has --help, clear errors and does what it says."""

from __future__ import annotations

import getpass
import io
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, ManagementUtility, call_command
from django.utils import timezone

from control.models import Event, Node, Profile, Replica
from gateway.models import ApiKey, TeamLimits, UserLimits
from tests.harness.factories import (
    make_key,
    make_model,
    make_node,
    make_profile,
    make_replica,
    make_usage,
    make_user,
)
from tests.harness.procs import REPO_ROOT
from tests.harness.store import child_env

OURS = [
    "revoke_api_key",
    "list_nodes",
    "list_replicas",
    "cordon",
    "drain",
    "undrain",
    "export_catalog",
    "import_catalog",
    "usage_report",
    "restart_replica",
    "scale_model",
    "pin_model",
    "delete_model",
    "create_admin_token",
    "revoke_admin_token",
    "set_limits",
    "create_user",
    "set_user",
    "create_team",
    "set_team_members",
    "delete_team",
    "delete_profile",
    "signin_link",
]


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


@pytest.mark.parametrize("command", OURS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        ManagementUtility(["manage.py", command, "--help"]).execute()
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: manage.py {command}")
    assert len(text.split("\n\n")[1].strip()) > 20  # a real description, not just flags


@pytest.mark.django_db(transaction=True)
def test_a_command_error_exits_non_zero_with_the_message_on_stderr() -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "cordon", "no-such-node"],
        cwd=REPO_ROOT,
        env=child_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "no such node: no-such-node" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- nodes


@pytest.mark.django_db
def test_run_with_identity_required_refuses_to_start_a_local_agent_it_would_refuse(
    settings: Any,
) -> None:
    """LLMGW_AGENT_REQUIRE_IDENTITY refuses node tokens everywhere, so the local agent (which
    has a token) could never connect: run says so at start instead of refusing it for ever."""
    settings.LLMGW_AGENT_REQUIRE_IDENTITY = True
    with pytest.raises(CommandError, match="--no-agent"):
        call_command("run", "--port", "1")
    assert not Node.objects.exists()  # it stopped before issuing the local agent's token


@pytest.mark.django_db
def test_cordon_drain_undrain_change_the_schedule_and_say_so() -> None:
    make_node("gpu-1")
    make_node("gpu-2")
    assert run("cordon", "gpu-1", "gpu-2") == "gpu-1: cordoned\ngpu-2: cordoned\n"
    assert run("cordon", "gpu-1") == "gpu-1: already cordoned\n"
    assert run("drain", "gpu-2") == "gpu-2: draining\n"
    assert run("undrain", "gpu-1", "gpu-2") == "gpu-1: active\ngpu-2: active\n"
    assert set(Node.objects.values_list("schedule", flat=True)) == {Node.Schedule.ACTIVE}
    assert Event.objects.filter(kind=Event.Kind.OPERATOR, message__contains="by cli").count() == 5


@pytest.mark.django_db
def test_cordon_with_an_unknown_node_changes_nothing() -> None:
    make_node("gpu-1")
    with pytest.raises(CommandError, match="no such node: gpu-9"):
        run("cordon", "gpu-1", "gpu-9")
    assert Node.objects.get().schedule == Node.Schedule.ACTIVE


@pytest.mark.django_db
def test_list_nodes_shows_state_gpus_and_memory() -> None:
    gpu1 = make_node("gpu-1", gpus=[(81920, 40960), (81920, 0)])
    make_node("gpu-2", health=Node.Health.UNREACHABLE, heartbeat_age_s=30)
    make_replica(make_model("llama3"), [(gpu1, [0])])
    lines = run("list_nodes").splitlines()
    assert lines[0].split() == ["NODE", "STATE", "GPUS", "MEMORY", "USED", "HEARTBEAT", "AGENT"]
    assert lines[1].split()[:5] == ["gpu-1", "ready", "1/2", "40.0/160.0", "GiB"]
    assert lines[2].split()[:3] == ["gpu-2", "unreachable", "0/1"]
    data = json.loads(run("list_nodes", "--json"))
    assert [n["name"] for n in data] == ["gpu-1", "gpu-2"]
    assert data[0]["gpus"][0]["allocated_to"].startswith("llama3#")


@pytest.mark.django_db
def test_list_nodes_with_no_nodes_says_how_to_add_one() -> None:
    assert "issue_node_token" in run("list_nodes")


@pytest.mark.django_db
def test_list_replicas_shows_where_each_runs() -> None:
    node = make_node("gpu-1", gpus=[(81920, 0)] * 2)
    llama = make_model("llama3")
    running = make_replica(llama, [(node, [0, 1])])
    make_replica(
        llama, [(node, [])], desired=Replica.Desired.STOPPED, observed=Replica.Observed.STOPPED
    )
    lines = run("list_replicas").splitlines()
    assert len(lines) == 2
    assert lines[1].split()[:5] == [str(running.pk), "llama3", "llama3-sim", "running", "ready"]
    assert f"gpu-1:0,1:{running.shards.get().port}" in lines[1]
    assert len(json.loads(run("list_replicas", "--all", "--json"))) == 2
    with pytest.raises(CommandError, match="no model 'nope'"):
        run("list_replicas", "--model", "nope")


# --------------------------------------------------------------------------- keys


@pytest.mark.django_db
def test_revoke_api_key_by_prefix_or_whole_key() -> None:
    make_user("alice")
    first_key, first = make_key("alice")
    _, second = make_key("alice")
    assert run("revoke_api_key", second.prefix) == f"{second.prefix}… (alice): revoked\n"
    assert run("revoke_api_key", first_key) == f"{first.prefix}… (alice): revoked\n"
    assert run("revoke_api_key", first.prefix) == f"{first.prefix}… (alice): already revoked\n"
    assert ApiKey.objects.filter(revoked_at__isnull=True).count() == 0


@pytest.mark.django_db
def test_revoke_api_key_that_does_not_exist_never_echoes_it() -> None:
    make_user("alice")
    _, key = make_key("alice")
    secret = "llmgw-" + "x" * 43
    with pytest.raises(CommandError) as error:
        run("revoke_api_key", key.prefix, secret)
    assert secret not in str(error.value)
    assert "argument 2" in str(error.value) and "nothing was revoked" in str(error.value)
    assert ApiKey.objects.get().revoked_at is None


# --------------------------------------------------------------------------- usage


@pytest.mark.django_db
def test_usage_report_sums_by_model_user_key_and_day() -> None:
    make_user("alice")
    make_user("bob")
    _, alice = make_key("alice")
    _, bob = make_key("bob")
    make_usage(
        model="llama3", api_key=alice, prompt_tokens=100, completion_tokens=10, cached_tokens=64
    )
    make_usage(model="llama3", api_key=bob, prompt_tokens=1, completion_tokens=2, status=500)
    make_usage(model="qwen", api_key=bob, prompt_tokens=5, completion_tokens=5)
    make_usage(model="old", api_key=bob, started_at=timezone.now() - timedelta(days=40))

    by_model = json.loads(run("usage_report", "--format", "json"))
    assert by_model == [
        {"group": "llama3", "requests": 2, "errors": 1, "prompt_tokens": 101,
         "completion_tokens": 12, "total_tokens": 113, "cached_tokens": 64},
        {"group": "qwen", "requests": 1, "errors": 0, "prompt_tokens": 5,
         "completion_tokens": 5, "total_tokens": 10, "cached_tokens": 0},
    ]  # fmt: skip
    by_user = json.loads(run("usage_report", "--by", "user", "--format", "json"))
    assert [(r["group"], r["total_tokens"]) for r in by_user] == [("alice", 110), ("bob", 13)]
    by_key = run("usage_report", "--by", "key", "--user", "bob", "--format", "csv")
    assert (
        by_key.splitlines()[0]
        == "group,requests,errors,prompt_tokens,completion_tokens,total_tokens,cached_tokens"
    )
    assert by_key.splitlines()[1:] == [f"{bob.prefix},2,1,6,7,13,0"]
    days = json.loads(run("usage_report", "--since", "60d", "--by", "day", "--format", "json"))
    assert [d["requests"] for d in days] == [1, 3]
    table = run("usage_report", "--model", "qwen")
    assert "qwen" in table and "llama3" not in table


@pytest.mark.django_db
def test_usage_report_refuses_a_bad_range() -> None:
    with pytest.raises(CommandError, match="--since 'yesterday' is not a date"):
        run("usage_report", "--since", "yesterday")
    with pytest.raises(CommandError, match="--until must be after --since"):
        run("usage_report", "--since", "2026-02-01", "--until", "2026-01-01")


# --------------------------------------------------------------------------- catalog


@pytest.mark.django_db
def test_export_then_import_catalog_through_a_file(tmp_path: Path) -> None:
    make_model("llama3", aliases=["llama"], pinned=True)
    target = tmp_path / "catalog.yaml"
    run("export_catalog", "-o", str(target))
    assert "name: llama3" in target.read_text()
    assert run("import_catalog", str(target)).splitlines() == ["0 created, 0 updated, 2 unchanged"]
    edited = target.read_text().replace("pinned: true", "pinned: false")
    target.write_text(edited)
    assert run("import_catalog", str(target), "--dry-run").splitlines() == [
        "updated model llama3",
        "dry run, nothing written: 0 created, 1 updated, 1 unchanged",
    ]
    assert run("import_catalog", str(target)).splitlines()[0] == "updated model llama3"


@pytest.mark.django_db
def test_import_catalog_errors_name_the_file_and_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match=r"cannot read .*missing\.yaml"):
        run("import_catalog", str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    default_profile: nope\n    source: s\n")
    with pytest.raises(CommandError, match=r"no profile named 'nope'.*nothing was imported"):
        run("import_catalog", str(bad))


@pytest.mark.django_db
def test_set_limits_sets_keeps_lifts_and_clears_a_users_and_a_teams_limits() -> None:
    alice = make_user("alice")
    out = run("set_limits", "--user", "alice", "--models", "b,a", "--rpm", "5", "--budget", "9")
    assert out == "user alice: models a, b; rpm 5, tpm none, budget 9 per month, self-service on\n"
    run("set_limits", "--user", "alice", "--rpm", "none", "--self-service", "off")
    row = UserLimits.objects.get(user=alice)
    assert (row.allowed_models, row.rpm_limit, row.token_budget, row.self_service) == (
        ["a", "b"],
        None,
        9,
        False,
    )
    Group.objects.create(name="ml")
    assert run("set_limits", "--team", "ml", "--tpm", "100").startswith("team ml: models all;")
    assert TeamLimits.objects.get(team__name="ml").tpm_limit == 100
    assert run("set_limits", "--user", "alice", "--clear") == "user alice: limits removed\n"
    assert run("set_limits", "--user", "alice", "--clear") == "user alice: no limits\n"
    assert not UserLimits.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--user", "nobody", "--rpm", "1"], "no user 'nobody'"),
        (["--team", "nobody", "--rpm", "1"], "no team 'nobody'"),
        (["--user", "alice"], "give a limit"),
        (["--user", "alice", "--rpm", "-1"], "--rpm"),
        (["--user", "alice", "--rpm", "lots"], "--rpm"),
        (["--user", "alice", "--clear", "--rpm", "1"], "--clear takes no"),
        (["--team", "ml", "--self-service", "off"], "a user's, not a team's"),
        (["--user", "alice", "--team", "ml", "--rpm", "1"], "not allowed with"),
    ],
)
def test_set_limits_refuses_what_it_cannot_do_and_changes_nothing(
    args: list[str], says: str
) -> None:
    make_user("alice")
    Group.objects.create(name="ml")
    with pytest.raises(CommandError, match=says):
        run("set_limits", *args)
    assert not UserLimits.objects.exists() and not TeamLimits.objects.exists()


@pytest.mark.django_db
def test_people_commands_make_change_and_delete_users_and_teams_and_say_so() -> None:
    make_user("alice")
    assert run("create_team", "ml", "--members", "alice") == "team ml: members alice\n"
    out = run("create_user", "bob", "--email", "bob@example.com", "--teams", "ml")
    assert out == "user bob: active; email bob@example.com; teams ml\n"
    assert not User.objects.get(username="bob").has_usable_password()
    out = run("set_user", "bob", "--staff", "on", "--active", "off", "--teams", "")
    assert out == "user bob: inactive, staff; email bob@example.com; teams -\n"
    assert run("set_team_members", "ml", "--members", "bob,alice") == (
        "team ml: members alice, bob\n"
    )
    assert run("set_team_members", "ml", "--members", "") == "team ml: members -\n"
    assert run("delete_team", "ml") == "team ml: deleted\n"
    assert not Group.objects.exists()
    assert [e.message for e in Event.objects.order_by("id")] == [
        "created by cli:" + getpass.getuser() + ": members alice",
        "created by cli:" + getpass.getuser() + ": email bob@example.com, teams ml, no password",
        "changed by cli:" + getpass.getuser() + ": is_active True → False, is_staff False → True,"
        " teams ml → none",
        "changed by cli:" + getpass.getuser() + ": members alice → alice,bob",
        "changed by cli:" + getpass.getuser() + ": members alice,bob → none",
        "deleted by cli:" + getpass.getuser(),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["create_user", "alice"], "username: user 'alice' exists"),
        (["create_user", "bad name"], "username: letters, digits"),
        (["create_user", "bob", "--teams", "ml,nope"], "teams: no team named nope"),
        (["create_user", "bob", "--email", "not-an-address"], "email: 'not-an-address' is not"),
        (["set_user", "nobody", "--staff", "on"], "username: no user 'nobody'"),
        (["set_user", "alice"], "give something to change"),
        (["set_user", "alice", "--staff", "yes"], "--staff"),
        (["set_user", "alice", "--staff", "on", "--teams", "nope"], "teams: no team named nope"),
        (["create_team", "ml"], "name: team 'ml' exists"),
        (["create_team", "new", "--members", "alice,nobody"], "members: no user named nobody"),
        (["set_team_members", "nope", "--members", "alice"], "name: no team 'nope'"),
        (["set_team_members", "ml", "--members", "nobody"], "members: no user named nobody"),
        (["set_team_members", "ml"], "--members"),
        (["delete_team", "nope"], "no team 'nope'"),
    ],
)
def test_people_commands_refuse_what_they_cannot_do_and_change_nothing(
    args: list[str], says: str
) -> None:
    make_user("alice")
    Group.objects.create(name="ml").user_set.add(User.objects.get(username="alice"))
    before = (
        sorted(User.objects.values_list("username", "email", "is_staff", "is_active")),
        sorted(Group.objects.values_list("name", "user__username")),
    )
    with pytest.raises(CommandError, match=says):
        run(*args)
    after = (
        sorted(User.objects.values_list("username", "email", "is_staff", "is_active")),
        sorted(Group.objects.values_list("name", "user__username")),
    )
    assert after == before
    assert not Event.objects.exists()


@pytest.mark.django_db
def test_delete_profile_refuses_a_profile_in_use_and_deletes_a_spare_one() -> None:
    model = make_model("llama3")
    node = make_node("gpu-1")
    spare = make_profile("vllm-tp2")
    model.profiles.add(spare)
    Replica.objects.filter(pk=make_replica(model, [(node, [0])]).pk).update(profile=spare)
    for name, says in (
        ("llama3-sim", "profile 'llama3-sim' is the default of llama3"),
        ("vllm-tp2", "profile 'vllm-tp2' runs replicas of llama3"),
        ("nope", "no profile 'nope'"),
    ):
        with pytest.raises(CommandError, match=says):
            run("delete_profile", name)
    assert Profile.objects.count() == 2 and not Event.objects.exists()
    Replica.objects.all().delete()
    assert run("delete_profile", "vllm-tp2") == "vllm-tp2: deleted\n"
    assert list(model.profiles.values_list("name", flat=True)) == ["llama3-sim"]
    assert Event.objects.get().message == f"deleted by cli:{getpass.getuser()} (offered by llama3)"


@pytest.mark.django_db
def test_a_start_up_makes_its_administrator_beside_a_plain_user_named_admin() -> None:
    """A user called ``admin`` who is not a superuser (made with ``create_user``) neither stops
    the start-up nor becomes its administrator: the new superuser takes the next free name."""
    from llmgw_site.management.commands.run import ensure_admin

    run("create_user", "admin")
    User.objects.create_user("admin-2")
    password = ensure_admin()
    assert password
    made = User.objects.get(is_superuser=True)
    assert made.username == "admin-3" and made.check_password(password)
    plain = User.objects.get(username="admin")
    assert not plain.is_superuser and not plain.is_staff and not plain.has_usable_password()
    assert ensure_admin() is None  # one superuser is enough; nothing more is made
    assert User.objects.filter(is_superuser=True).count() == 1
