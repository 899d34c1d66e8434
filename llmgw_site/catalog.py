"""The catalog as YAML: profiles, models and static endpoints, exported and imported.

Import is idempotent: rows are matched by their natural key (a profile's and a model's
``name``, an endpoint's ``id``), only fields that differ are written, and importing the same
file twice changes nothing the second time. The whole file is validated before anything is
written, and written in one transaction, so a bad file leaves the catalog as it was. Nothing
absent from the file is deleted: an import adds and updates, it does not prune.

Fields come from the models' own metadata (every editable column), so a field added to a model
is exported and imported without touching this module. A profile is checked as the agent would
check it (``control.profiles``) before it is written.

It lives at the site level because one file spans both apps: profiles and models are the
control plane's, static endpoints the gateway's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml
from django.core.exceptions import ValidationError
from django.db import models, transaction

from control.models import Profile, ProfileScale, ServedModel
from control.profiles import wire_problems
from gateway.models import Endpoint

FORMAT_VERSION = 1
_M = TypeVar("_M", bound=models.Model)


class CatalogError(Exception):
    """The file cannot be imported; the message says where and why."""


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


def export() -> dict[str, Any]:
    """The whole catalog as plain data, in a stable order."""
    profiles = [_values(p, _columns(Profile)) for p in Profile.objects.order_by("name")]
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


def export_yaml() -> str:
    return yaml.safe_dump(export(), sort_keys=False, allow_unicode=True)


# --------------------------------------------------------------------------- import


@dataclass
class ImportResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{len(self.created)} created, {len(self.updated)} updated, "
            f"{len(self.unchanged)} unchanged"
        )


def _entries(data: Mapping[str, Any], section: str) -> list[Mapping[str, Any]]:
    entries = data.get(section) or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CatalogError(f"{section}: must be a list of mappings")
    return entries


def _assign(
    row: _M, entry: Mapping[str, Any], columns: list[models.Field[Any, Any]], where: str
) -> bool:
    """Copy the entry's fields onto ``row``; True if any differed. Unknown keys are errors."""
    known = {f.name: f for f in columns}
    changed = False
    for key, value in entry.items():
        column = known.get(key)
        if column is None:
            raise CatalogError(f"{where}: unknown field {key!r} (known: {', '.join(known)})")
        try:
            cleaned = column.to_python(value)
        except ValidationError as exc:
            raise CatalogError(f"{where}.{key}: {'; '.join(exc.messages)}") from None
        if column.value_from_object(row) != cleaned:
            setattr(row, column.attname, cleaned)
            changed = True
    return changed


def _validate(row: models.Model, where: str, *, exclude: Iterable[str] = ()) -> None:
    try:
        row.full_clean(exclude=list(exclude), validate_unique=False)
    except ValidationError as exc:
        details = "; ".join(
            f"{name}: {' '.join(messages)}" for name, messages in exc.message_dict.items()
        )
        raise CatalogError(f"{where}: {details}") from None


def _name(entry: Mapping[str, Any], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise CatalogError(f"{where}: needs a {key!r}")
    return value


def import_data(data: object, *, dry_run: bool = False) -> ImportResult:
    """Create or update every entry in ``data`` (the shape :func:`export` writes)."""
    if not isinstance(data, dict):
        raise CatalogError("the catalog must be a mapping with profiles, models, endpoints")
    unknown = set(data) - {"version", "profiles", "models", "endpoints"}
    if unknown:
        raise CatalogError(f"unknown top-level keys: {', '.join(sorted(unknown))}")
    if data.get("version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CatalogError(f"version {data.get('version')!r} is not {FORMAT_VERSION}")
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


def _save(row: models.Model, changed: bool, label: str, result: ImportResult) -> None:
    if row.pk is None:
        row.save()
        result.created.append(label)
    elif changed:
        row.save()
        result.updated.append(label)
    else:
        result.unchanged.append(label)


def _import_profiles(entries: list[Mapping[str, Any]], result: ImportResult) -> None:
    columns = _columns(Profile)
    for i, entry in enumerate(entries):
        where = f"profiles[{i}]"
        name = _name(entry, "name", where)
        row = Profile.objects.filter(name=name).first() or Profile(name=name)
        changed = _assign(row, entry, columns, f"profile {name}")
        _validate(row, f"profile {name}")
        problems = wire_problems(
            args=row.args, env=row.env, health_path=row.health_path, gpu_selector=row.gpu_selector
        )
        if problems:
            details = "; ".join(f"{k}: {v}" for k, v in problems.items())
            raise CatalogError(f"profile {name}: {details}")
        _save(row, changed, f"profile {name}", result)


def _profile(name: object, where: str) -> Profile:
    profile = Profile.objects.filter(name=str(name)).first()
    if profile is None:
        raise CatalogError(f"{where}: no profile named {name!r} (in the file or the catalog)")
    return profile


def _import_models(entries: list[Mapping[str, Any]], result: ImportResult) -> None:
    columns = _columns(ServedModel)
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        name = _name(entry, "name", where)
        fields = dict(entry)
        default = _profile(_name(fields, "default_profile", f"model {name}"), f"model {name}")
        fields.pop("default_profile")
        counts = fields.pop("profile_replicas", None)
        profile_names = fields.pop("profiles", None) or [default.name]
        if not isinstance(profile_names, list):
            raise CatalogError(f"model {name}: profiles must be a list of profile names")
        profiles = {_profile(p, f"model {name}") for p in profile_names} | {default}
        row = ServedModel.objects.filter(name=name).first() or ServedModel(name=name)
        changed = _assign(row, fields, columns, f"model {name}")
        if row.pk is None or row.default_profile_id != default.pk:
            row.default_profile = default
            changed = True
        _validate(row, f"model {name}")
        _save(row, changed, f"model {name}", result)
        changed_counts = False
        if counts is not None:
            changed_counts = _import_profile_replicas(row, counts, profiles - {default})
        if set(row.profiles.all()) != profiles or changed_counts:
            row.profiles.set(profiles)
            if f"model {name}" in result.unchanged:
                result.unchanged.remove(f"model {name}")
                result.updated.append(f"model {name}")


def _import_profile_replicas(row: ServedModel, counts: object, others: set[Profile]) -> bool:
    """Make the model's rows under its other profiles exactly ``counts`` (name → min/max);
    True if any changed. A file without the key leaves them as they are."""
    where = f"model {row.name}: profile_replicas"
    if not isinstance(counts, dict):
        raise CatalogError(f"{where} must map profile names to min_replicas/max_replicas")
    by_name = {p.name: p for p in others}
    wanted: dict[int, tuple[int, int]] = {}
    for profile_name, entry in counts.items():
        profile = by_name.get(profile_name)
        if profile is None:
            raise CatalogError(f"{where}: {profile_name!r} is not one of its other profiles")
        if not isinstance(entry, dict) or set(entry) - {"min_replicas", "max_replicas"}:
            raise CatalogError(f"{where}.{profile_name}: needs min_replicas and max_replicas")
        low, high = entry.get("min_replicas", 0), entry.get("max_replicas", 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)) or not (
            0 <= low <= high <= 32767
        ):
            raise CatalogError(f"{where}.{profile_name}: needs 0 <= min_replicas <= max_replicas")
        wanted[profile.pk] = (low, high)
    changed = False
    for scale in row.scales.all():
        if scale.profile_id not in wanted:
            scale.delete()
            changed = True
    for profile_id, (low, high) in wanted.items():
        scale, created = ProfileScale.objects.get_or_create(
            model=row, profile_id=profile_id, defaults={"min_replicas": low, "max_replicas": high}
        )
        if not created and (scale.min_replicas, scale.max_replicas) != (low, high):
            ProfileScale.objects.filter(pk=scale.pk).update(min_replicas=low, max_replicas=high)
            changed = True
        changed = changed or created
    return changed


def _import_endpoints(entries: list[Mapping[str, Any]], result: ImportResult) -> None:
    columns = _columns(Endpoint, skip=["slug"])
    for i, entry in enumerate(entries):
        where = f"endpoints[{i}]"
        slug = _name(entry, "id", where)
        fields = {k: v for k, v in entry.items() if k != "id"}
        if "models" in fields:
            fields["model_names"] = fields.pop("models")
        row = Endpoint.objects.filter(slug=slug).first() or Endpoint(slug=slug)
        changed = _assign(row, fields, columns, f"endpoint {slug}")
        _validate(row, f"endpoint {slug}")
        _save(row, changed, f"endpoint {slug}", result)
