"""JSON schemas for editors (``jobgen schema``), generated from the pydantic models so
the field descriptions are the one reference documentation."""

from __future__ import annotations

from typing import Any

from jobgen.spec.tables.run import RunSpec
from jobgen.spec.tables.site import SiteProfile


def site_schema() -> dict[str, Any]:
    return SiteProfile.model_json_schema()


def run_schema() -> dict[str, Any]:
    schema = RunSpec.model_json_schema()
    site = SiteProfile.model_json_schema()
    defs = schema.setdefault("$defs", {})
    defs.update(site.pop("$defs", {}))
    override = {
        "type": "object",
        "description": "A site profile plus overrides of any of its keys.",
        "properties": {
            "profile": {"type": "string", "description": "Profile name (<name>.toml on the site search path) or path."},
            **{k: v for k, v in site["properties"].items() if k != "name"},
        },
        "required": ["profile"],
        "additionalProperties": False,
    }
    schema["properties"] = {
        "site": {
            "description": (
                "Site profile: a name such as 'local', a path to a TOML file, or a table with 'profile' and overrides."
            ),
            "anyOf": [{"type": "string"}, override],
            "default": "local",
        },
        **schema["properties"],
    }
    schema["title"] = "jobgen run.toml"
    return schema
