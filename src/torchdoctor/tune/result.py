"""What tune hands back: every trial, the noise, the verification and the winner.

Plain dataclasses shared by the process tuner (`torchdoctor tune`), the notebook API and the
renderers. ``TuneResult.to_json()`` is the documented ``--json`` output.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from torchdoctor.compare.stats import Interval
from torchdoctor.tune.space import Config

# Measurement.status values
OK = "ok"  # measured
FAILED = "failed"  # crashed, hung, killed, or too few steps to measure
REJECTED = "rejected"  # ran, but pushed memory past the budget or made the host swap
INTERRUPTED = "interrupted"  # stopped by Ctrl-C or by the end of the budget


@dataclass(slots=True)
class Measurement:
    """One trial: a configuration run once and measured."""

    index: int
    config: Config
    purpose: str  # "original", "suggested", "search", "confirm", "verify-original", "verify-tuned"
    status: str
    throughput: float | None = None  # steps/s over the measured window
    samples_per_s: float | None = None
    steps: int = 0  # measured steps (after warm-up)
    warmup_steps: int = 0
    spread: float | None = None  # relative standard error within the trial (block rates)
    data_wait_share: float | None = None  # share of step time spent waiting for data
    peak_memory: int | None = None  # bytes: job's summed PSS (RSS where PSS is unknown)
    duration_s: float = 0.0  # wall time of the whole trial, start-up included
    first_step_s: float | None = None  # from the start to the first training step
    reason: str = ""  # why it failed / was rejected / was cut
    recording: str | None = None
    log: str | None = None
    step_s: list[float] = field(default_factory=list)  # each measured step's time, in order

    @property
    def ok(self) -> bool:
        return self.status == OK and self.throughput is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "config": self.config.as_dict(),
            "purpose": self.purpose,
            "status": self.status,
            "steps_per_s": self.throughput,
            "samples_per_s": self.samples_per_s,
            "measured_steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "spread": self.spread,
            "data_wait_share": self.data_wait_share,
            "peak_memory_bytes": self.peak_memory,
            "duration_s": round(self.duration_s, 3),
            "reason": self.reason,
            "recording": self.recording,
            "log": self.log,
        }


@dataclass(slots=True)
class Verification:
    """Interleaved runs of the original (A) and the tuned configuration (B): A B A B ..."""

    original: list[float]  # steps/s of each A run, in run order
    tuned: list[float]
    ratios: list[float]  # tuned / original speed of each adjacent pair
    confirmed: bool  # every pair shows the gain and the gain is beyond the noise
    reason: str = ""
    # The gain (A's step time over B's) with its ~95 % interval, by compare's statistics over
    # the steps of all A runs and all B runs (torchdoctor.compare.stats.speedup): the same
    # definition as `torchdoctor compare`'s ratio. None where the runs kept no step times
    # (the notebook API's trials): the gain is then the mean of the pair ratios.
    interval: Interval | None = None

    @property
    def pairs(self) -> int:
        return len(self.ratios)

    @property
    def gain(self) -> float | None:
        if self.interval is not None:
            return self.interval.estimate
        return statistics.fmean(self.ratios) if self.ratios else None

    @property
    def gain_spread(self) -> float | None:
        """Half the range of the pair ratios: the gain is ``gain +- gain_spread``."""
        if len(self.ratios) < 2:
            return None
        return (max(self.ratios) - min(self.ratios)) / 2

    def to_json(self) -> dict[str, Any]:
        return {
            "pairs": self.pairs,
            "original_steps_per_s": self.original,
            "tuned_steps_per_s": self.tuned,
            "ratios": self.ratios,
            "gain": self.gain,
            "gain_spread": self.gain_spread,
            "gain_low": self.interval.low if self.interval is not None else None,
            "gain_high": self.interval.high if self.interval is not None else None,
            "confirmed": self.confirmed,
            "reason": self.reason,
        }


@dataclass(slots=True)
class TuneResult:
    """The outcome of a tune. ``recommended`` is what to use: the original unless a gain was
    verified."""

    original: Config
    recommended: Config
    candidate: Config | None  # the search's pick before verification (None: search found none)
    trials: list[Measurement]
    noise: float  # relative difference below which two throughputs count as equal
    verification: Verification | None
    stopped: str  # why the search ended: "converged", "budget", "interrupted", "no-trials"
    elapsed_s: float
    search_s: float  # time until the candidate was chosen (verification excluded)
    budget_s: float | None
    unit_note: str = ""
    explores: list[str] = field(default_factory=list)  # settings the search varied
    notes: list[str] = field(default_factory=list)  # things the user should know
    threads_set_in_script: bool = False  # the script calls torch.set_num_threads itself
    memory_budget: int | None = None  # bytes the job may use
    trial_steps: int | None = None  # measured steps per trial (after warm-up)
    stop_signal: int | None = None  # the signal that interrupted the tune (its exit: 128 + it)

    @property
    def changed(self) -> bool:
        return self.recommended != self.original

    @property
    def gain(self) -> float | None:
        if self.verification is None or not self.verification.confirmed:
            return None
        return self.verification.gain

    @property
    def dataloader_kwargs(self) -> dict[str, Any]:
        """The recommended settings as ``DataLoader(...)`` keyword arguments."""
        return self.recommended.dataloader_kwargs()

    def __repr__(self) -> str:
        gain = f"{self.gain:.2f}x" if self.gain is not None else "none verified"
        return (
            f"TuneResult(recommended={self.recommended.label()!r}, "
            f"original={self.original.label()!r}, gain={gain}, trials={len(self.trials)}, "
            f"stopped={self.stopped!r})"
        )

    def summary(self) -> str:
        """Plain-text account: each trial, then the outcome (for notebooks and logs)."""
        base = self.best_throughput(self.original)
        lines = [f"{'#':>3}  {'run':<16} {'settings':<24} {'steps/s':>9} {'vs orig.':>8}  result"]
        for m in self.trials:
            speed = f"{m.throughput:9.2f}" if m.throughput is not None else f"{'-':>9}"
            ratio = f"{m.throughput / base:7.2f}x" if m.throughput and base else f"{'-':>8}"
            status = m.status + (f" ({m.reason})" if m.reason else "")
            lines.append(
                f"{m.index:>3}  {m.purpose:<16} {m.config.label():<24} {speed} {ratio}  {status}"
            )
        lines.append(f"noise between runs: +-{self.noise:.0%}; search stopped: {self.stopped}")
        if self.changed and self.gain is not None:
            v = self.verification
            spread = f" +- {v.gain_spread:.2f}" if v.gain_spread is not None else ""
            if v.interval is not None:
                spread = f" (95 % interval {v.interval.low:.2f} to {v.interval.high:.2f})"
            lines.append(f"verified gain {self.gain:.2f}x{spread} over {v.pairs} interleaved pairs")
            lines.append(f"use: DataLoader(..., {self.paste()['dataloader_code']})")
            lines.append(f"and: {self.paste()['set_num_threads']}")
        else:
            lines.append("keep your settings: nothing was verified faster")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def best_throughput(self, config: Config) -> float | None:
        values = [m.throughput for m in self.trials if m.ok and m.config == config]
        return statistics.fmean(values) if values else None

    def paste(self) -> dict[str, Any]:
        """What to put in the script and the shell to get the recommended settings."""
        kwargs = self.recommended.dataloader_kwargs()
        env = {"OMP_NUM_THREADS": str(self.recommended.num_threads)}
        lines = [f"export {k}={v}" for k, v in env.items()]
        return {
            "dataloader_kwargs": kwargs,
            "dataloader_code": ", ".join(f"{k}={v!r}" for k, v in kwargs.items()),
            "env": env,
            "env_lines": lines,
            "set_num_threads": f"torch.set_num_threads({self.recommended.num_threads})",
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "original": self.original.as_dict(),
            "recommended": self.recommended.as_dict(),
            "changed": self.changed,
            "candidate": self.candidate.as_dict() if self.candidate else None,
            "gain": self.gain,
            "gain_spread": self.verification.gain_spread if self.gain is not None else None,
            "verification": self.verification.to_json() if self.verification else None,
            "noise": self.noise,
            "stopped": self.stopped,
            "elapsed_s": round(self.elapsed_s, 3),
            "search_s": round(self.search_s, 3),
            "budget_s": self.budget_s,
            "memory_budget_bytes": self.memory_budget,
            "trial_steps": self.trial_steps,
            "explored": self.explores,
            "paste": self.paste() if self.changed else None,
            "notes": self.notes,
            "trials": [m.to_json() for m in self.trials],
        }
