"""`torchdoctor export FILE --format csv|parquet|jsonl|tensorboard [--out-dir DIR]`."""

from __future__ import annotations

from pathlib import Path

import click

from torchdoctor.cli.force import force_option
from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.parsing import Command
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.exporters.files import FORMATS, export
from torchdoctor.recording import open_recording


@click.command("export", cls=Command, renamed={"--to": "--out-dir"})
@click.argument("file", type=RECORDING)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(tuple(FORMATS)),
    required=True,
    help="Output format.",
)
@click.option(
    "--out-dir",
    "folder",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Folder for the exported files (default: <recording>-<format>/ beside it).",
)
@force_option("files of an earlier export in DIR")
@click.option("--json", "as_json", is_flag=True, help="Print the files written as JSON.")
def command(file: str, fmt: str, folder: str | None, force: bool, as_json: bool) -> None:
    """Export every table of the recording FILE, one file per table, plus meta.json.

    Files already in DIR are replaced only with --force; nothing is written when one is there.

    With --format tensorboard: the recording's scalars (step time, data wait, samples/s, job
    CPU and PSS, GPU and host figures) as a TensorBoard run, DIR/<recording name>/.
    """
    with open_recording(file) as rec:
        target = Path(folder) if folder else rec.path.with_name(f"{rec.path.stem}-{fmt}")
        written = export(rec, fmt, target, force=force)
    if as_json:
        dump_json(
            "export", {"format": fmt, "folder": str(target), "files": [str(p) for p in written]}
        )
        return
    for path in written:
        click.echo(str(path))
