"""What a profile becomes on the wire, checked the way the agent checks it; and its secrets.

The checks an agent applies to a profile's argument template, environment names and health
path run when an operator saves a profile (and when a catalog file is imported), so a bad
profile is refused at the admin instead of breaking every node stream that carries it.

A profile's environment holds secrets (``HF_TOKEN``, an API key of a model hub): everyone but a
superuser is shown them as :data:`MASK` (``masked_env``), in the admin, the admin API, exports.
A document that comes back with the mask where a secret was keeps the stored secret
(``unmasked_env``), so a masked export applied again changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from agents.protocol.messages import DesiredShard
from agents.protocol.vocabulary import ProtocolError

MASK = "********"
# Names that say "secret" anywhere in them, and words that do when they stand alone
# (HF_TOKEN, AWS_SECRET_ACCESS_KEY, WANDB_API_KEY, DB_PASSWORD, NGC_PAT).
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|APIKEY|PRIVATE", re.IGNORECASE)
_SECRET_WORDS = frozenset({"KEY", "PASS", "PWD", "AUTH", "PAT", "SIGNATURE", "COOKIE"})
# Values that are tokens whatever their name: well-known prefixes, or one long run of
# letters and digits (no path, no model name: those have slashes).
_SECRET_VALUE = re.compile(
    r"(hf_|sk-|ghp_|gho_|github_pat_|glpat-|xox[abpr]-|AKIA)\S+|(?=\S*\d)(?=\S*[A-Za-z])[\w+=-]{32,}"
)


def is_secret(name: str, value: str) -> bool:
    """Whether an environment variable looks like a secret, by its name or by its value."""
    words = set(re.split(r"[^A-Za-z0-9]+", name.upper()))
    return bool(
        _SECRET_NAME.search(name) or words & _SECRET_WORDS or _SECRET_VALUE.fullmatch(value)
    )


def masked_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment as those who may not see its secrets see it."""
    return {
        name: MASK if value and is_secret(name, value) else value for name, value in env.items()
    }


class MaskedValue(ValueError):
    """A variable came back masked, and no stored secret of that name is there to keep."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} is masked ({MASK}); give its value")
        self.name = name


def unmasked_env(env: Mapping[str, str], stored: Mapping[str, str]) -> dict[str, str]:
    """``env`` with each masked value replaced by the stored one it stands for. MaskedValue:
    one stands for nothing stored."""
    out = dict(env)
    for name, value in env.items():
        if value == MASK:
            kept = stored.get(name)
            if kept is None or not is_secret(name, kept):
                raise MaskedValue(name)
            out[name] = kept
    return out


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
