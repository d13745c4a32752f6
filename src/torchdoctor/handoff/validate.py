"""A manifest checked strictly against the API models the projects publish on PyPI.

The API server drops a field it does not know without a word (a typo'd ``nprocPerNode`` under
``trainer`` is simply gone), so every key is checked against the model's fields, and every
value against the field's type: TrainJob against ``kubeflow-trainer-api`` (Trainer's generated
pydantic models), PyTorchJob against ``kubeflow-training`` (the training-operator 1.9 SDK's
OpenAPI models) and a Job against the ``kubernetes`` client's. Neither kind of model refuses an
unknown field itself (pydantic's default ignores extras; the OpenAPI models drop them), hence the
walk here. The text as written is what is checked: it is read back with PyYAML.
"""

from __future__ import annotations

import importlib
import typing
from typing import Any

from torchdoctor.errors import UserError

EXTRA = "pip install 'torchdoctor[kubernetes]'"
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),
    "datetime": (str,),
    "date": (str,),
}


def models_available() -> bool:
    try:
        for name in ("yaml", "kubeflow_trainer_api", "kubernetes.client"):
            importlib.import_module(name)
    except ImportError:
        return False
    return True


def model_versions() -> dict[str, str]:
    """The installed model packages' versions (said in the manifest's header and the docs)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("kubeflow-trainer-api", "kubeflow-training", "kubernetes"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def validate_text(text: str) -> list[str]:
    """Problems of the manifest ``text``, one line each ("path: what is wrong")."""
    try:
        import yaml
    except ImportError:
        raise UserError(f"reading a manifest back needs PyYAML: {EXTRA}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return [f"not YAML: {str(exc).splitlines()[0]}"]
    return validate_doc(doc)


def validate_doc(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return ["manifest: not a mapping"]
    kind, api = doc.get("kind"), doc.get("apiVersion")
    errors: list[str] = []
    if (kind, api) == ("TrainJob", "trainer.kubeflow.org/v1alpha1"):
        models = _import("kubeflow_trainer_api.models", "kubeflow-trainer-api")
        cls = models.TrainerV1alpha1TrainJob
        _walk_pydantic(cls, doc, kind, errors)
        if not errors:
            errors += _pydantic_types(cls, doc)
    elif (kind, api) == ("PyTorchJob", "kubeflow.org/v1"):
        models = _import("kubeflow.training.models", "kubeflow-training")
        _walk_openapi(models, "KubeflowOrgV1PyTorchJob", doc, kind, errors)
        if not errors:
            errors += _openapi_required(
                "kubeflow.training.api_client", "KubeflowOrgV1PyTorchJob", doc
            )
    elif (kind, api) == ("Job", "batch/v1"):
        models = _import("kubernetes.client.models", "kubernetes")
        _walk_openapi(models, "V1Job", doc, kind, errors)
        if not errors:
            errors += _openapi_required("kubernetes.client.api_client", "V1Job", doc)
    else:
        errors.append(f"manifest: kind {kind!r} apiVersion {api!r} is not one torchdoctor writes")
    return errors


def _import(module: str, dist: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"validating needs {dist}: {EXTRA}") from None


# --- pydantic (kubeflow-trainer-api) ---------------------------------------------------------


def _walk_pydantic(cls: Any, data: Any, path: str, errors: list[str]) -> None:
    if not isinstance(data, dict):
        errors.append(f"{path}: expected a mapping, not {type(data).__name__}")
        return
    fields = {(f.alias or name): f for name, f in cls.model_fields.items()}
    if "actual_instance" in fields:  # a oneOf wrapper (Quantity, IntOrString): a scalar
        return
    for key, value in data.items():
        if key not in fields:
            errors.append(f"{path}.{key}: unknown field (the API server would drop it silently)")
            continue
        _walk_type(fields[key].annotation, value, f"{path}.{key}", errors)


def _walk_type(tp: Any, value: Any, path: str, errors: list[str]) -> None:
    from pydantic import BaseModel

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "types.UnionType"):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            _walk_type(inner[0], value, path, errors)
        return
    if origin is list and isinstance(value, list):
        for i, item in enumerate(value):
            _walk_type(args[0], item, f"{path}[{i}]", errors)
    elif origin is dict and isinstance(value, dict):
        for key, item in value.items():
            _walk_type(args[1], item, f"{path}.{key}", errors)
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        fields = tp.model_fields
        if "actual_instance" in fields:
            return
        _walk_pydantic(tp, value, path, errors)


def _pydantic_types(cls: Any, doc: dict[str, Any]) -> list[str]:
    """The models' own type checks (StrictInt, StrictStr, required fields)."""
    from pydantic import ValidationError

    try:
        cls.from_dict(doc)
    except ValidationError as exc:
        return [
            f"{doc.get('kind')}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors()
        ]
    except (ValueError, TypeError) as exc:
        return [f"{doc.get('kind')}: {exc}"]
    return []


# --- OpenAPI models (kubernetes, kubeflow-training) ------------------------------------------


def _walk_openapi(models: Any, type_name: str, data: Any, path: str, errors: list[str]) -> None:
    if type_name.startswith("list["):
        if not isinstance(data, list):
            errors.append(f"{path}: expected a list, not {type(data).__name__}")
            return
        for i, item in enumerate(data):
            _walk_openapi(models, type_name[5:-1], item, f"{path}[{i}]", errors)
        return
    if type_name.startswith("dict("):
        if not isinstance(data, dict):
            errors.append(f"{path}: expected a mapping, not {type(data).__name__}")
            return
        inner = type_name[type_name.index(",") + 1 : -1].strip()
        for key, item in data.items():
            _walk_openapi(models, inner, item, f"{path}.{key}", errors)
        return
    if type_name in _PRIMITIVES:
        ok = isinstance(data, _PRIMITIVES[type_name]) and not (
            type_name in ("int", "float") and isinstance(data, bool)
        )
        if not ok:
            errors.append(f"{path}: expected {type_name}, not {type(data).__name__} {data!r}")
        return
    cls = getattr(models, type_name, None)
    if cls is None:
        return  # a type the package does not model (IntOrString): the schema's own business
    if not isinstance(data, dict):
        errors.append(f"{path}: expected a mapping, not {type(data).__name__}")
        return
    by_key = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    for key, value in data.items():
        if key not in by_key:
            errors.append(f"{path}.{key}: unknown field (the API server would drop it silently)")
            continue
        _walk_openapi(models, cls.openapi_types[by_key[key]], value, f"{path}.{key}", errors)


def _openapi_required(client_module: str, type_name: str, doc: dict[str, Any]) -> list[str]:
    """The models' own checks while they are built (required fields, enums)."""
    module = importlib.import_module(client_module)
    client = module.ApiClient()
    try:
        client._ApiClient__deserialize(doc, type_name)  # the public deserialize wants a response
    except (ValueError, TypeError) as exc:
        return [f"{doc.get('kind')}: {str(exc).splitlines()[0]}"]
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            close()
    return []
