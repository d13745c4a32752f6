"""The public entry points spell out their keywords, each documented once and handed on as given."""

from __future__ import annotations

import inspect
import pydoc

import pytest

from torchdoctor.estimate import api


@pytest.mark.parametrize("entry", [api.estimate, api.max_batch, api.prepare])
def test_every_keyword_is_in_the_signature_and_documented_in_help(entry):
    params = inspect.signature(entry).parameters
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "model")
    text = pydoc.render_doc(entry, renderer=pydoc.plaintext)
    args = text[text.index("Args:") : text.index("Returns:")]
    for name in params:
        first_line = api._ARGS[name].split("\n")[0]
        assert f"{name}: {first_line}" in args, name
    # in signature order, nothing else
    listed = [line.split(":")[0].strip() for line in args.splitlines() if ": " in line]
    assert [n for n in listed if n in params] == list(params)


class _Prepared(Exception):
    pass


@pytest.mark.parametrize("entry", [api.estimate, api.max_batch])
def test_entry_points_hand_prepare_every_argument_as_given(entry, monkeypatch):
    seen = {}

    def prepare(model, **kwargs):
        seen.update(kwargs, model=model)
        raise _Prepared

    monkeypatch.setattr(api, "prepare", prepare)
    given = {
        "input_shape": "3x32x32",
        "optimizer": "sgd",
        "precision": "bf16-mixed",
        "grad_accumulation": 4,
        "gpu": "L4",
        "margin": 0.2,
        "fallback": False,
    }
    with pytest.raises(_Prepared):
        entry("m.py:make", **given)
    assert seen["model"] == "m.py:make"
    for name, value in given.items():
        assert seen[name] == value
    own = set(inspect.signature(entry).parameters) - {"model"}
    # every prepare() keyword the entry point has is passed on; its own extras are not
    assert set(seen) - {"model"} == own & set(api._PREPARE_KEYWORDS)
