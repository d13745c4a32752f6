"""Check a --json document against the schema torchdoctor ships for it."""

from __future__ import annotations

import json

from torchdoctor.cli.json_output import SCHEMA_VERSIONS, schema_path


def assert_valid(name: str, document: dict | str) -> dict:
    """``document`` (or its JSON text) validates against ``<name>.schema.json``; returned."""
    import jsonschema

    data = json.loads(document) if isinstance(document, str) else document
    schema = json.loads(schema_path(name).read_text())
    jsonschema.Draft202012Validator(schema).validate(data)
    assert data["schema_version"] == SCHEMA_VERSIONS[name]
    return data
