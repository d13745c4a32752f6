"""The one compiled part: the agent's per-batch and per-step fast path (optional).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built (no
C compiler, no Python headers) the install goes on and the agent runs its pure-Python path;
`torchdoctor doctor` says which one a Python gets.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "torchdoctor.instrument.agent._fast",
            sources=["src/torchdoctor/instrument/agent/_fast.c"],
            optional=True,
        )
    ]
)
