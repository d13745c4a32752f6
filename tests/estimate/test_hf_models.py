"""`hf:MODEL_TYPE` builds a Hugging Face model from its default config (no download) and
estimates it like any other model."""

from __future__ import annotations

import re


def test_gpt2_from_config_estimates_weights_gradients_and_adam_state(estimate_cli):
    code, out, err = estimate_cli("hf:gpt2", "--tokens", "16", "--batch", "2")
    assert code == 0, err
    # GPT-2 small: 124,439,808 parameters (the LM head shares the token embedding).
    assert "124.4 M parameters" in out
    rows = dict(
        re.findall(
            r"^\s+(parameters|gradients|optimizer state)\s+(\d[\d.]* [KMGT]?i?B)\b", out, re.M
        )
    )
    # fp32: 4 B each; AdamW keeps two moments per parameter.
    assert rows == {
        "parameters": "475 MiB",
        "gradients": "475 MiB",
        "optimizer state": "949 MiB",
    }
