"""`torchdoctor export FILE --format csv|parquet|jsonl|tensorboard [--to DIR]`."""

from __future__ import annotations

from pathlib import Path

import click

from torchdoctor.exporters.files import FORMATS, export
from torchdoctor.recording import open_recording


@click.command("export")
@click.argument("file", type=click.Path(dir_okay=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(tuple(FORMATS)),
    required=True,
    help="Output format.",
)
@click.option(
    "--to",
    "folder",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Folder for the exported files (default: <recording>-<format>/ beside it).",
)
def command(file: str, fmt: str, folder: str | None) -> None:
    """Export every table of the recording FILE, one file per table, plus meta.json.

    With --format tensorboard: the recording's scalars (step time, data wait, samples/s, job
    CPU and PSS, GPU and host figures) as a TensorBoard run, DIR/<recording name>/.
    """
    with open_recording(file) as rec:
        target = Path(folder) if folder else rec.path.with_name(f"{rec.path.stem}-{fmt}")
        written = export(rec, fmt, target)
    for path in written:
        click.echo(str(path))
