"""``torchdoctor completion bash|zsh|fish``: the shell's completion script, from click.

Commands, options, choices, recordings (``last`` and the files of the recordings folder) and
queued job ids complete. Install, e.g. for bash: ``torchdoctor completion bash >>
~/.bashrc`` (or ``eval "$(torchdoctor completion bash)"``); zsh: ``~/.zshrc``; fish:
``torchdoctor completion fish > ~/.config/fish/completions/torchdoctor.fish``.
"""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_TORCHDOCTOR_COMPLETE"  # what click reads, from the program's name


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
def command(shell: str) -> None:
    """Print the completion script for SHELL (bash, zsh or fish) on stdout."""
    from torchdoctor.cli import cli

    completion = get_completion_class(shell)
    if completion is None:  # a click without this shell's support
        raise click.UsageError(f"this click cannot complete {shell}")
    click.echo(completion(cli, {}, "torchdoctor", COMPLETE_VAR).source())
