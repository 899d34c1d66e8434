"""The catalog as YAML: profiles, models and static endpoints, exported and imported.

Import is idempotent: rows are matched by their natural key (a profile's and a model's
``name``, an endpoint's ``id``), only fields that differ are written, and importing the same
file twice changes nothing the second time. The whole file is validated before anything is
written, and written in one transaction, so a bad file leaves the catalog as it was. Nothing
absent from the file is deleted: an import adds and updates, it does not prune. A file is YAML,
or JSON when its name ends in ``.json`` (the admin API's export); ``manage.py import_catalog``
and ``manage.py run --catalog`` read it with :func:`import_file`.

Imports may race: control planes starting together each apply the same ``--catalog`` file.
The unique constraints arbitrate (a profile's and a model's name, an endpoint's id, a model's
profile): the import whose insert meets a row another committed meanwhile loses its whole
transaction and runs again over that row, which it now finds; so racers end with the rows
one import alone would have made, and none fails.

Fields come from the models' own metadata (every editable column), so a field added to a model
is exported and imported without touching this module. A profile is checked as the agent would
check it (``control.profiles``) before it is written.

Secrets in profile environments are exported masked unless the caller may see them (a
superuser, a read-write admin token, ``export_catalog --with-secrets``); importing a masked
value keeps the secret stored under that name, so a masked export applied back changes nothing,
and a masked value with no stored secret behind it is refused.

It lives at the site level because one file spans both apps: profiles and models are the
control plane's, static endpoints the gateway's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction

from control.models import Profile, ProfileScale, ServedModel
from control.profiles import MaskedValue, masked_env, unmasked_env, wire_problems
from gateway.models import Endpoint

FORMAT_VERSION = 1
# An import that lost a race for a row runs again over the winner's rows, where the same file
# inserts nothing more; more tries only serve racers applying different files.
IMPORT_ATTEMPTS = 5
_M = TypeVar("_M", bound=models.Model)


class CatalogError(Exception):
    """The file cannot be imported; the message says where and why, ``field`` is the path of
    the value at fault (``models[0].min_replicas``; empty for the document as a whole)."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


# --------------------------------------------------------------------------- export


def _columns(
    model: type[models.Model], *, skip: Iterable[str] = ()
) -> list[models.Field[Any, Any]]:
    """Editable concrete non-relation columns, in declaration order."""
    skipped = {"id", *skip}
    return [
        f
        for f in model._meta.concrete_fields
        if f.editable and not f.is_relation and f.name not in skipped
    ]


def _values(row: models.Model, columns: Iterable[models.Field[Any, Any]]) -> dict[str, Any]:
    return {f.name: f.value_from_object(row) for f in columns}


def profile_values(profile: Profile, *, reveal_secrets: bool) -> dict[str, Any]:
    """A profile's exported fields; its environment's secrets masked unless ``reveal_secrets``."""
    values = _values(profile, _columns(Profile))
    if not reveal_secrets:
        values["env"] = masked_env(values["env"] or {})
    return values


def export(*, reveal_secrets: bool) -> dict[str, Any]:
    """The whole catalog as plain data, in a stable order; secrets in profile environments
    masked unless ``reveal_secrets``."""
    profiles = [
        profile_values(p, reveal_secrets=reveal_secrets) for p in Profile.objects.order_by("name")
    ]
    served = []
    for model in ServedModel.objects.select_related("default_profile").prefetch_related(
        "profiles", "scales__profile"
    ):
        entry = _values(model, _columns(ServedModel))
        entry["default_profile"] = model.default_profile.name
        entry["profiles"] = sorted(p.name for p in model.profiles.all())
        scales = sorted(model.scales.all(), key=lambda s: s.profile.name)
        if scales:
            # Replica counts under its other profiles (the default's are the model's own).
            entry["profile_replicas"] = {
                s.profile.name: {"min_replicas": s.min_replicas, "max_replicas": s.max_replicas}
                for s in scales
            }
        served.append(entry)
    endpoints = []
    for endpoint in Endpoint.objects.order_by("slug"):
        entry = _values(endpoint, _columns(Endpoint, skip=["slug", "model_names"]))
        endpoints.append({"id": endpoint.slug, **entry, "models": list(endpoint.model_names)})
    return {
        "version": FORMAT_VERSION,
        "profiles": profiles,
        "models": served,
        "endpoints": endpoints,
    }


def export_yaml(*, reveal_secrets: bool) -> str:
    return yaml.safe_dump(
        export(reveal_secrets=reveal_secrets), sort_keys=False, allow_unicode=True
    )


# --------------------------------------------------------------------------- import


Change = dict[str, Any]  # {"from": old, "to": new}


@dataclass
class ImportResult:
    """What an import did (or, dry, would do): entries by label, and for each created or
    updated entry the fields it sets, each with its value before and after."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    changes: dict[str, dict[str, Change]] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"{len(self.created)} created, {len(self.updated)} updated, "
            f"{len(self.unchanged)} unchanged"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "created": self.created,
            "updated": self.updated,
            "unchanged": self.unchanged,
            "changes": self.changes,
        }


def _entries(data: Mapping[str, Any], section: str) -> list[Mapping[str, Any]]:
    entries = data.get(section) or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CatalogError(f"{section}: must be a list of mappings", field=section)
    return entries


def _plain(value: Any) -> Any:
    """A value as the document spells it (a JSON/YAML scalar, list or mapping)."""
    return value.isoformat() if hasattr(value, "isoformat") else value


def _assign(
    row: _M,
    entry: Mapping[str, Any],
    columns: list[models.Field[Any, Any]],
    where: str,
    path: str,
) -> dict[str, Change]:
    """Copy the entry's fields onto ``row``; the fields that differed, with both values.
    Unknown keys are errors."""
    known = {f.name: f for f in columns}
    changes: dict[str, Change] = {}
    for key, value in entry.items():
        column = known.get(key)
        if column is None:
            raise CatalogError(
                f"{where}: unknown field {key!r} (known: {', '.join(known)})", field=f"{path}.{key}"
            )
        try:
            cleaned = column.to_python(value)
        except ValidationError as exc:
            raise CatalogError(
                f"{where}.{key}: {'; '.join(exc.messages)}", field=f"{path}.{key}"
            ) from None
        before = column.value_from_object(row)
        if before != cleaned or row.pk is None:
            if before != cleaned:
                setattr(row, column.attname, cleaned)
            changes[key] = {
                "from": None if row.pk is None else _plain(before),
                "to": _plain(cleaned),
            }
    return changes


def _validate(row: models.Model, where: str, path: str, *, exclude: Iterable[str] = ()) -> None:
    try:
        row.full_clean(exclude=list(exclude), validate_unique=False)
    except ValidationError as exc:
        details = "; ".join(
            f"{name}: {' '.join(messages)}" for name, messages in exc.message_dict.items()
        )
        # A constraint spanning fields (min within max) is reported on the first it names.
        first = next(iter(exc.message_dict), "")
        if first == "__all__":
            first = _constraint_field(exc.messages[0])
        raise CatalogError(
            f"{where}: {details}", field=f"{path}.{first}" if first else path
        ) from None


def _constraint_field(message: str) -> str:
    return "min_replicas" if "min_replicas" in message else ""


def _name(entry: Mapping[str, Any], key: str, where: str, path: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise CatalogError(f"{where}: needs a {key!r}", field=f"{path}.{key}")
    return value


def import_data(data: object, *, dry_run: bool = False) -> ImportResult:
    """Create or update every entry in ``data`` (the shape :func:`export` writes), all or
    nothing. ``dry_run`` does the same work and rolls it back: the result is exactly what an
    import would do now."""
    if not isinstance(data, dict):
        raise CatalogError("the catalog must be a mapping with profiles, models, endpoints")
    unknown = set(data) - {"version", "profiles", "models", "endpoints"}
    if unknown:
        raise CatalogError(
            f"unknown top-level keys: {', '.join(sorted(unknown))}", field=sorted(unknown)[0]
        )
    if data.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CatalogError(
            f"version {data.get('version')!r} is not {FORMAT_VERSION}", field="version"
        )
    for _ in range(IMPORT_ATTEMPTS - 1):
        # Another import committed a row this one was inserting (the module's docstring): this
        # transaction is gone, and the next finds that row.
        with contextlib.suppress(IntegrityError):
            return _import_once(data, dry_run=dry_run)
    return _import_once(data, dry_run=dry_run)


def _import_once(data: Mapping[str, Any], *, dry_run: bool) -> ImportResult:
    result = ImportResult()
    with transaction.atomic():
        _import_profiles(_entries(data, "profiles"), result)
        _import_models(_entries(data, "models"), result)
        _import_endpoints(_entries(data, "endpoints"), result)
        if dry_run:
            transaction.set_rollback(True)
    return result


def import_yaml(text: str, *, dry_run: bool = False) -> ImportResult:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogError(f"not valid YAML: {exc}") from None
    return import_data(data, dry_run=dry_run)


def import_file(path: Path, *, dry_run: bool = False) -> ImportResult:
    """Import the catalog file at ``path``: JSON when its name ends in ``.json``, else YAML.
    A file that cannot be read raises ``OSError``, for the caller to name as it names it."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() != ".json":
        return import_yaml(text, dry_run=dry_run)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CatalogError(f"not valid JSON: {exc}") from None
    return import_data(data, dry_run=dry_run)


def _save(row: models.Model, changes: dict[str, Change], label: str, result: ImportResult) -> None:
    if row.pk is None:
        row.save()
        result.created.append(label)
        result.changes[label] = changes
    elif changes:
        row.save()
        result.updated.append(label)
        result.changes[label] = changes
    else:
        result.unchanged.append(label)


def _import_profiles(entries: list[Mapping[str, Any]], result: ImportResult) -> None:
    columns = _columns(Profile)
    for i, given in enumerate(entries):
        path = f"profiles[{i}]"
        name = _name(given, "name", path, path)
        where = f"profile {name}"
        row = Profile.objects.filter(name=name).first() or Profile(name=name)
        entry = dict(given)
        if isinstance(entry.get("env"), dict):
            try:
                entry["env"] = unmasked_env(entry["env"], row.env or {})
            except MaskedValue as exc:
                raise CatalogError(f"{where}: env {exc}", field=f"{path}.env.{exc.name}") from None
        changes = _assign(row, entry, columns, where, path)
        _validate(row, where, path)
        problems = wire_problems(
            args=row.args, env=row.env, health_path=row.health_path, gpu_selector=row.gpu_selector
        )
        if problems:
            details = "; ".join(f"{k}: {v}" for k, v in problems.items())
            raise CatalogError(f"{where}: {details}", field=f"{path}.{next(iter(problems))}")
        _save(row, changes, where, result)


def _profile(name: object, where: str, path: str) -> Profile:
    profile = Profile.objects.filter(name=str(name)).first()
    if profile is None:
        raise CatalogError(
            f"{where}: no profile named {name!r} (in the file or the catalog)", field=path
        )
    return profile


def _import_models(entries: list[Mapping[str, Any]], result: ImportResult) -> None:
    columns = _columns(ServedModel)
    for i, entry in enumerate(entries):
        path = f"models[{i}]"
        name = _name(entry, "name", path, path)
        where = f"model {name}"
        fields = dict(entry)
        default_name = _name(fields, "default_profile", where, path)
        default = _profile(default_name, where, f"{path}.default_profile")
        fields.pop("default_profile")
        counts = fields.pop("profile_replicas", None)
        profile_names = fields.pop("profiles", None) or [default.name]
        if not isinstance(profile_names, list):
            raise CatalogError(
                f"{where}: profiles must be a list of profile names", field=f"{path}.profiles"
            )
        profiles = {
            _profile(p, where, f"{path}.profiles[{j}]") for j, p in enumerate(profile_names)
        } | {default}
        row = ServedModel.objects.filter(name=name).first() or ServedModel(name=name)
        changes = _assign(row, fields, columns, where, path)
        if row.pk is None or row.default_profile_id != default.pk:
            before = None if row.pk is None else row.default_profile.name
            row.default_profile = default
            changes["default_profile"] = {"from": before, "to": default.name}
        _validate(row, where, path)
        before_profiles = sorted(p.name for p in row.profiles.all()) if row.pk else None
        after_profiles = sorted(p.name for p in profiles)
        if before_profiles != after_profiles:
            changes["profiles"] = {"from": before_profiles, "to": after_profiles}
        wanted = None
        if counts is not None:
            wanted = _profile_replicas(counts, profiles - {default}, where, path)
            before_counts = _current_profile_replicas(row) if row.pk else {}
            if before_counts != wanted:
                changes["profile_replicas"] = {"from": before_counts, "to": wanted}
        _save(row, changes, where, result)
        if wanted is not None:
            _set_profile_replicas(row, wanted, profiles - {default})
        if before_profiles != after_profiles:
            row.profiles.set(profiles)


def _profile_replicas(
    counts: object, others: set[Profile], where: str, path: str
) -> dict[str, dict[str, int]]:
    """``profile_replicas`` checked: the model's other profiles by name, each with its
    min/max replicas. A file without the key leaves the model's rows as they are."""
    where, path = f"{where}: profile_replicas", f"{path}.profile_replicas"
    if not isinstance(counts, dict):
        raise CatalogError(
            f"{where} must map profile names to min_replicas/max_replicas", field=path
        )
    names = {p.name for p in others}
    wanted: dict[str, dict[str, int]] = {}
    for profile_name, entry in counts.items():
        at = f"{path}.{profile_name}"
        if profile_name not in names:
            raise CatalogError(
                f"{where}: {profile_name!r} is not one of its other profiles", field=at
            )
        if not isinstance(entry, dict) or set(entry) - {"min_replicas", "max_replicas"}:
            raise CatalogError(
                f"{where}.{profile_name}: needs min_replicas and max_replicas", field=at
            )
        low, high = entry.get("min_replicas", 0), entry.get("max_replicas", 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not (
            0 <= low <= high <= 32767
        ):
            raise CatalogError(
                f"{where}.{profile_name}: needs 0 <= min_replicas <= max_replicas", field=at
            )
        wanted[profile_name] = {"min_replicas": low, "max_replicas": high}
    return wanted


def _current_profile_replicas(row: ServedModel) -> dict[str, dict[str, int]]:
    return {
        scale.profile.name: {"min_replicas": scale.min_replicas, "max_replicas": scale.max_replicas}
        for scale in row.scales.select_related("profile")
    }


def _set_profile_replicas(
    row: ServedModel, wanted: dict[str, dict[str, int]], others: set[Profile]
) -> None:
    """Make the model's rows under its other profiles exactly ``wanted``."""
    by_name = {p.name: p for p in others}
    row.scales.exclude(profile__name__in=list(wanted)).delete()
    for profile_name, counts in wanted.items():
        ProfileScale.objects.update_or_create(
            model=row, profile=by_name[profile_name], defaults=counts
        )


def _import_endpoints(entries: list[Mapping[str, Any]], result: ImportResult) -> None:
    columns = _columns(Endpoint, skip=["slug"])
    for i, entry in enumerate(entries):
        path = f"endpoints[{i}]"
        slug = _name(entry, "id", path, path)
        where = f"endpoint {slug}"
        fields = {k: v for k, v in entry.items() if k != "id"}
        if "models" in fields:
            fields["model_names"] = fields.pop("models")
        row = Endpoint.objects.filter(slug=slug).first() or Endpoint(slug=slug)
        changes = _assign(row, fields, columns, where, path)
        if "model_names" in changes:
            changes["models"] = changes.pop("model_names")
        _validate(row, where, path)
        _save(row, changes, where, result)
