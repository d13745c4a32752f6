"""Readers of the machine: the host, the job's processes and the GPUs.

Each reader is a small object with ``read() -> <plain dataclass>``; none of them writes,
prints or imports torch. Their results travel to the recording and the interfaces as the
dataclasses in :mod:`torchdoctor.sampling.types`.
"""
