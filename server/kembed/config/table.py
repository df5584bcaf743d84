"""The configuration tables, one per :class:`~kembed.config.values.Group`, generated from the
settings' field descriptions (``python -m kembed --env-table``; ``docs/configuration.md`` holds the
copy a test compares).
"""

from __future__ import annotations

from kembed.config.settings import Settings
from kembed.config.values import Group
from kembed.contract import env_name

GROUP_TITLES = {
    Group.USER: "What you set",
    Group.TUNING: "Tuning knobs",
    Group.OPERATOR: "What the operator sets",
}
GROUP_NOTES = {
    Group.USER: "The model, where the server listens, TLS, logging, and the latency targets admission holds.",
    Group.TUNING: "Batching, admission and limits. The defaults are measured; change one with a reason.",
    Group.OPERATOR: (
        "The operator sets these from the pod it renders (its CPU request, its grace period, the compile "
        "cache volume). Outside Kubernetes, set them if you need them."
    ),
}


def group_of(name: str) -> Group:
    """The group a setting belongs to."""
    extra = Settings.model_fields[name].json_schema_extra
    group = extra.get("group") if isinstance(extra, dict) else None
    if not isinstance(group, str):
        raise ValueError(f"setting {name} has no group")
    return Group(group)


def env_table(group: Group) -> str:
    """One group's configuration table, from the field descriptions."""
    rows = ["| Variable | Default | Meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        if group_of(name) is not group:
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list):
            default = ",".join(str(getattr(v, "value", v)) for v in default)
        default = getattr(default, "value", default)
        shown = "(unset)" if default is None else f"`{default}`" if default != "" else "(empty)"
        rows.append(f"| `{env_name(name)}` | {shown} | {field.description} |")
    return "\n".join(rows)


def env_tables() -> str:
    """Every group's table under its title, for ``python -m kembed --env-table``."""
    return "\n\n".join(f"### {GROUP_TITLES[g]}\n\n{GROUP_NOTES[g]}\n\n{env_table(g)}" for g in Group)
