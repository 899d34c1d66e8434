"""The secrets callers present as bearer credentials: API keys, admin tokens and node tokens.

The ground floor: it imports nothing of ours (a contract in ``pyproject.toml`` says so), so the
gateway, the control plane and the site mint and check their secrets with one helper.
"""
