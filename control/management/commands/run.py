"""`manage.py run` (what `make run` calls): llmgw on this machine, in one command.

Migrates the store, makes sure an administrator exists (printing a new one's password once),
then starts and supervises the web processes on one port until Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from control import launcher


def ensure_admin(username: str = "admin") -> str | None:
    """Create a superuser when there is none; return its new password, or None if one exists."""
    user_model = get_user_model()
    if user_model.objects.filter(is_superuser=True).exists():
        return None
    password = secrets.token_urlsafe(12)
    user_model.objects.create_superuser(username=username, email="", password=password)
    return password


class Command(BaseCommand):
    help = "Start llmgw on this machine: migrate, create an admin if needed, serve until Ctrl-C."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=os.environ.get("LLMGW_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("LLMGW_PORT", "8000")))
        parser.add_argument(
            "--web-processes",
            type=int,
            default=int(os.environ.get("LLMGW_WEB_PROCESSES", str(os.cpu_count() or 1))),
            help="Daphne processes sharing the port (default: one per core).",
        )

    def handle(self, *args: Any, host: str, port: int, web_processes: int, **options: Any) -> None:
        if web_processes < 1:
            raise CommandError("--web-processes must be at least 1")
        call_command("migrate", interactive=False, verbosity=0)
        password = ensure_admin()
        try:
            listener = launcher.bind_listener(host, port)
        except OSError as exc:
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}") from None

        base = f"http://{host}:{port}"
        backend = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        self.stdout.write(f"llmgw {settings.LLMGW_VERSION} on {backend}")
        self.stdout.write(f"  web processes: {web_processes} on {base}")
        self.stdout.write(f"  health:        {base}/healthz")
        self.stdout.write(f"  admin:         {base}/admin/")
        if password:
            self.stdout.write(
                f"  admin user:    admin / {password}   (shown once; change it in the admin)"
            )
        else:
            self.stdout.write(
                "  admin user:    exists (its password was shown when it was created)"
            )
        self.stdout.write(f"  OpenAI base_url for clients: {base}/v1")
        self.stdout.write("Ctrl-C stops everything.")
        self.stdout.flush()

        supervisor = launcher.Supervisor(
            launcher.web_children(listener, web_processes, access_log=settings.LLMGW_ACCESS_LOG)
        )
        supervisor.run()
