"""``python -m torchdoctor`` is the ``torchdoctor`` command."""

from torchdoctor.cli import main

main()
