"""What a profile becomes on the wire, checked the way the agent checks it.

The checks an agent applies to a profile's argument template, environment names and health
path run when an operator saves a profile (and when a catalog file is imported), so a bad
profile is refused at the admin instead of breaking every node stream that carries it.
"""

from __future__ import annotations

from agents.protocol.messages import DesiredShard
from agents.protocol.vocabulary import ProtocolError


def wire_problems(
    *, args: object, env: object, health_path: object, gpu_selector: object
) -> dict[str, str]:
    """Field → what the agent would refuse about a profile (empty when it would take it).

    Checked by building the very message the control plane sends (``DesiredShard``) with the
    agent's own validation, so this cannot disagree with the agent.
    """
    problems: dict[str, str] = {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        problems["args"] = "must be a list of strings"
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        problems["env"] = 'must map names to string values, e.g. {"HF_HOME": "/data"}'
    if not isinstance(gpu_selector, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in gpu_selector.items()
    ):
        problems["gpu_selector"] = 'must map label names to string values, e.g. {"gpu": "h100"}'
    if problems:
        return problems
    probe = {
        "shard_id": 1,
        "replica_id": 1,
        "generation": 1,
        "state": "running",
        "engine": "sim",
        "model": "probe",
        "source": "probe",
        "port": 1,
        "args": args,
        "env": env,
        "health_path": health_path,
    }
    try:
        DesiredShard.from_dict(probe)
    except ProtocolError as exc:
        text = str(exc)
        where = next((name for name in ("env", "args", "health_path") if name in text), "args")
        problems[where] = text.removeprefix("shard.")
    return problems
