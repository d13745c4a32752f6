"""`torchdoctor show FILE [--json]`: the summary of a recording."""

from __future__ import annotations

import dataclasses

import click

from torchdoctor.cli.json_output import dump_json
from torchdoctor.cli.recordings import RECORDING
from torchdoctor.diagnosis.cuda_memory import recorded_snapshots
from torchdoctor.recording import open_recording
from torchdoctor.recording.reader import Recording
from torchdoctor.recording.summary import summarize
from torchdoctor.units import fmt_duration


@click.command("show")
@click.argument("file", type=RECORDING)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as JSON (documented in README)."
)
def command(file: str, as_json: bool) -> None:
    """Print the summary of the recording FILE: duration, peaks and means, steps, settings."""
    with open_recording(file) as rec:
        summary = summarize(rec)
        folded = folded_lines(rec)
        memory = recorded_snapshots(rec)  # run --memory-history: what was live at the peak
    if as_json:
        document = dataclasses.asdict(summary)
        document["cuda_memory"] = [dataclasses.asdict(s) for s in memory]
        dump_json("show", document)
        return
    from torchdoctor.run.end_report import memory_line, render_summary
    from torchdoctor.terminal import make_console

    console = make_console(soft_wrap=True)
    render_summary(summary, console)
    for line in folded:
        console.print(line)
    for snapshot in memory:
        console.print(memory_line(snapshot))


def folded_lines(rec: Recording) -> list[str]:
    """Which spans of the run hold folded samples (recording.compaction), one line each:
    a reader of the rows must know that there one row stands for a minute."""
    policy = rec.compaction
    spans = rec.summarised_spans()
    if policy is None or not spans:
        return []
    start = rec.started_at or spans[0].t_from
    lines = [
        f"samples folded (--keep compact): one row per process per {fmt_duration(policy.bucket_s)}"
        f" (means; min/max per {fmt_duration(policy.summary_s)} in the *_sample_summaries"
        " tables) in these spans of the run, every sample kept elsewhere:"
    ]
    for span in spans:
        lines.append(
            f"  {fmt_duration(span.t_from - start)} to {fmt_duration(span.t_to - start)} after"
            f" the start ({span.samples:,} samples)"
        )
    folded = rec.folded_steps
    if folded:
        steps = sum(f.count for f in folded.values())
        lines.append(
            f"steps folded there too: {steps:,} steps of {len(folded)} process(es) kept as counts,"
            f" sums and histograms per {fmt_duration(policy.bucket_s)} (step_summaries), about"
            f" {policy.step_rows:g} step rows per process per {fmt_duration(policy.bucket_s)}"
            " kept; the step figures above count every step"
        )
    return lines
