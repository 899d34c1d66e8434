#!/usr/bin/env python
"""llmgw's command line in a checkout: `python manage.py help` lists what operators can script
(installed, the same is the `llmgw` command: llmgw_site/__main__.py)."""

from llmgw_site.__main__ import main

if __name__ == "__main__":
    main()
