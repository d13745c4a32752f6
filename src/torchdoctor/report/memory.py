"""The report's CUDA memory section (run --memory-history): per memory snapshot, the peak
(allocated, reserved), its phases, the lines that held the most at that moment, the memory
reserved but free, and the request that failed."""

from __future__ import annotations

from html import escape

from torchdoctor.diagnosis.cuda_memory import MemoryPeak, RecordedSnapshot, phase_split
from torchdoctor.units import fmt_bytes


def render_memory(snapshots: list[RecordedSnapshot]) -> str:
    if not snapshots:
        return ""
    parts = ['<section id="memory"><h2>CUDA memory at the peak</h2>']
    for snapshot in snapshots:
        when = "at the out-of-memory error" if snapshot.kind == "oom" else "at the process' end"
        parts.append(f"<h3>Process {snapshot.pid}: snapshot taken {escape(when)}</h3>")
        parts.append(f'<p class="mono">{escape(snapshot.path)}</p>')
        if snapshot.peak is None:
            parts.append(f"<p>Not read: {escape(snapshot.error or '')}</p>")
        else:
            parts.append(_peak(snapshot.peak))
    parts.append("</section>")
    return "".join(parts)


def _peak(peak: MemoryPeak) -> str:
    facts = [f"{fmt_bytes(peak.peak_allocated)} allocated at the peak"]
    if peak.peak_reserved is not None:
        facts.append(f"{fmt_bytes(peak.peak_reserved)} reserved")
    if peak.fragmentation is not None:
        facts.append(
            f"when the snapshot was taken {fmt_bytes(peak.fragmentation)} reserved but free, "
            f"the largest free block {fmt_bytes(peak.largest_free_block)}"
        )
    if peak.failed is not None:
        failed = f"the request that failed: {fmt_bytes(peak.failed.bytes)}"
        if peak.failed.device_free is not None:
            failed += f" ({fmt_bytes(peak.failed.device_free)} free on the device)"
        facts.append(failed)
    out = [
        f"<p>{escape('; '.join(facts))}.</p>",
        f"<p>By phase: {escape(phase_split(peak))}.</p>",
        "<table><thead><tr><th>line (first frame of the job's own code)</th><th>phase</th>"
        '<th class="num">live at the peak</th><th class="num">share</th>'
        '<th class="num">blocks</th></tr></thead><tbody>',
    ]
    total = peak.peak_allocated or 1
    for site in peak.sites:
        out.append(
            f'<tr><td class="mono">{escape(site.where)}</td><td>{escape(site.phase)}</td>'
            f'<td class="num">{escape(fmt_bytes(site.bytes))}</td>'
            f'<td class="num">{100 * site.bytes / total:.1f} %</td>'
            f'<td class="num">{site.blocks:,}</td></tr>'
        )
    out.append("</tbody></table>")
    if peak.sites_total > len(peak.sites):
        out.append(f"<p>{peak.sites_total - len(peak.sites)} more lines held less.</p>")
    return "".join(out)
