"""llmgw's command line: ``manage.py`` in a checkout, ``llmgw`` (or ``python -m llmgw_site``)
where the wheel is installed; ``llmgw help`` lists what operators can script."""

from __future__ import annotations

import os
import sys

from django.core.exceptions import ImproperlyConfigured
from django.core.management import execute_from_command_line


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # Configuration errors name the variable; a traceback would only bury that line.
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
