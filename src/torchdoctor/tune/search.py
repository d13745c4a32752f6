"""The search: start from the job's own settings and the diagnosis' advice, climb locally,
stop when the next step is within the measured noise, then verify the pick against the
original in interleaved runs.

The search only sees a ``measure(config, purpose, deadline)`` callable, so the same logic
drives real processes (`torchdoctor tune`), in-process loaders (the notebook API) and the
deterministic synthetic functions of the tests.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torchdoctor.compare.stats import Interval, speedup, typical_step
from torchdoctor.compare.verdict import FASTER, verdict_of
from torchdoctor.tune.result import (
    INTERRUPTED,
    OK,
    REJECTED,
    Measurement,
    TuneResult,
    Verification,
)
from torchdoctor.tune.space import DIMENSIONS, Config, Space

Measure = Callable[[Config, str, float | None], Measurement]

NOISE_FLOOR = 0.03  # never call two throughputs different below 3 %: clocks, caches, the OS
NOISE_SIGMAS = 2.5  # a difference must exceed this many standard errors to count
DATA_BOUND_SHARE = 0.10
FINALISTS = 3  # re-measured before the pick
MAX_MOVES = 64  # far more than any space here needs; a guard, not a limit that bites  # above this share of data wait, more workers are tried before fewer


@dataclass(slots=True)
class SearchLimits:
    """How long the search may run and how much of it is kept for the verification."""

    deadline: float | None = None  # clock() value the whole tune must end by
    verify_pairs: int = 3  # A B pairs in the verification
    max_trials: int | None = None  # search trials at most (verification excluded)


def estimate_noise(trials: Iterable[Measurement], floor: float = NOISE_FLOOR) -> float:
    """Relative difference under which two throughputs are indistinguishable.

    Two sources, the larger wins: the spread between repeated runs of one configuration
    (pooled over every configuration measured more than once, in log space) and the spread
    within runs (the standard error of each run's block rates).
    """
    groups: dict[Config, list[float]] = {}
    within: list[float] = []
    for m in trials:
        if m.ok and m.throughput > 0:
            groups.setdefault(m.config, []).append(math.log(m.throughput))
            if m.spread is not None:
                within.append(m.spread)
    squares = 0.0
    dof = 0
    for values in groups.values():
        if len(values) > 1:
            mean = statistics.fmean(values)
            squares += sum((v - mean) ** 2 for v in values)
            dof += len(values) - 1
    sd_between = math.sqrt(squares / dof) if dof else 0.0
    sd_within = statistics.median(within) if within else 0.0
    # A comparison of two single runs carries the noise of both: sqrt(2) of one run's.
    sd = max(sd_between, sd_within * math.sqrt(2))
    return min(0.5, max(floor, NOISE_SIGMAS * sd))


class Search:
    """Local search over ``space`` from ``original``; :meth:`run` returns the full result."""

    def __init__(
        self,
        space: Space,
        measure: Measure,
        original: Config,
        *,
        suggestions: Iterable[Config] = (),
        limits: SearchLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        noise_floor: float = NOISE_FLOOR,
        first: Measurement | None = None,
    ) -> None:
        self.space = space
        self._measure_fn = measure
        self.original = original
        self.suggestions = [space.clamp(s) for s in suggestions]
        self.limits = limits or SearchLimits()
        self.clock = clock
        self.noise_floor = noise_floor
        self.trials: list[Measurement] = [first] if first is not None else []
        self.stopped = ""
        self._climb_noise: float | None = None
        self._search_trials = 0
        self._started = clock()

    # -- bookkeeping --------------------------------------------------------------------------

    def mean(self, config: Config) -> float | None:
        values = [m.throughput for m in self.trials if m.ok and m.config == config]
        return statistics.fmean(values) if values else None

    def count(self, config: Config) -> int:
        return sum(1 for m in self.trials if m.ok and m.config == config)

    def tried(self, config: Config) -> bool:
        return any(m.config == config for m in self.trials)

    @property
    def noise(self) -> float:
        return estimate_noise(self.trials, self.noise_floor)

    @property
    def climb_noise(self) -> float:
        """The noise the climb judges steps with (see :meth:`run`)."""
        return self._climb_noise if self._climb_noise is not None else self.noise

    def better(self, a: Config, b: Config) -> bool:
        """``a`` is faster than ``b`` by more than the noise."""
        ma, mb = self.mean(a), self.mean(b)
        return ma is not None and mb is not None and ma > mb * (1 + self.climb_noise)

    def worse(self, a: Config, b: Config) -> bool:
        """``a`` is slower than ``b`` by more than the noise (or could not be measured)."""
        ma, mb = self.mean(a), self.mean(b)
        return ma is None or (mb is not None and ma * (1 + self.climb_noise) < mb)

    def excluded(self, config: Config) -> bool:
        """Known to need more memory than a configuration already rejected for memory:
        at least as many workers, buffered batches and threads."""
        for m in self.trials:
            if m.status != REJECTED:
                continue
            r = m.config
            if (
                config.num_workers >= r.num_workers
                and config.num_workers * (config.prefetch_factor or 0)
                >= r.num_workers * (r.prefetch_factor or 0)
                and config.num_threads >= r.num_threads
                and config.persistent_workers >= r.persistent_workers
            ):
                return True
        return False

    def trial_estimate(self) -> float:
        """Expected wall time of one trial, from the ones that ran to the end."""
        done = [m.duration_s for m in self.trials if m.ok]
        return statistics.median(done) if done else 0.0

    def _longest(self, config: Config | None = None) -> float:
        """The longest completed trial (of ``config``, or of any configuration)."""
        done = [m.duration_s for m in self.trials if m.ok and config in (None, m.config)]
        return max(done, default=0.0)

    def _pair_estimate(self, candidate: Config | None = None) -> float:
        """Time one verification pair may take: a run of the original (often the slowest
        configuration) and a run of the candidate (the longest trial when not yet known)."""
        tuned = self._longest(candidate) if candidate is not None else 0.0
        # A margin: trials of one configuration vary with what else the machine does.
        return 1.15 * (self._longest(self.original) + (tuned or self._longest()))

    def remaining(self) -> float:
        if self.limits.deadline is None:
            return math.inf
        return self.limits.deadline - self.clock()

    def _room_for_search_trial(self) -> bool:
        if self.limits.max_trials is not None and self._search_trials >= self.limits.max_trials:
            return False
        estimate = self.trial_estimate()
        # Keep room for the smallest verification that can show a spread (2 pairs); a
        # longer one runs when the search ends early.
        reserve = min(2, self.limits.verify_pairs) * self._pair_estimate()
        return self.remaining() > estimate + reserve

    def _measure(self, config: Config, purpose: str) -> Measurement:
        deadline = self.limits.deadline
        m = self._measure_fn(config, purpose, deadline)
        self.trials.append(m)
        if m.status == INTERRUPTED and not self.stopped:
            self.stopped = "budget" if "budget" in m.reason else "interrupted"
        return m

    def _search_measure(self, config: Config, purpose: str = "search") -> Measurement | None:
        """Measure one more configuration if the budget allows; None when it does not."""
        if self.stopped:
            return None
        if not self._room_for_search_trial():
            self.stopped = "budget"
            return None
        self._search_trials += 1
        m = self._measure(config, purpose)
        return None if self.stopped else m

    # -- the search ---------------------------------------------------------------------------

    def run(self) -> TuneResult:
        original = self.original
        if not self.trials:
            self._measure(original, "original")
        if not any(m.ok and m.config == original for m in self.trials):
            return self._result(None, None, stopped=self.stopped or "original-failed")
        # A second run of the original: the first estimate of run-to-run noise.
        if self.count(original) < 2 and not self.stopped:
            self._measure(original, "original")
        # Two runs that disagree say little about which one is typical: a third tells.
        runs = [m.throughput for m in self.trials if m.ok and m.config == original]
        if len(runs) == 2 and max(runs) > min(runs) * (1 + 2 * self.noise_floor):
            self._search_measure(original, "original")
        for suggestion in self.suggestions:
            if not self.tried(suggestion) and not self.excluded(suggestion):
                self._search_measure(suggestion, "suggested")
        self._climb_from(self._best_config())
        candidate = self._confirm()
        # Judged with the noise of the calmest repeated runs, the neighbourhood of the pick
        # may hold steps the first climb called noise: climb again with that noise.
        local = self._finalist_noise()
        if candidate is not None and local < self.noise and not self.stopped:
            self._climb_noise = local
            self._climb_from(candidate)
            candidate = self._confirm()
        search_s = self.clock() - self._started
        verification = None
        if candidate is not None and candidate != original and self.stopped != "interrupted":
            verification = self.verify(candidate)
        return self._result(candidate, verification, search_s=search_s)

    def _climb_from(self, current: Config) -> None:
        for _ in range(MAX_MOVES):
            if self.stopped:
                return
            moved = self._climb(current)
            if moved is None:
                return  # converged, unless the budget or an interrupt said stop
            current = moved

    def _climb(self, current: Config) -> Config | None:
        """The first neighbour clearly faster than ``current``, followed along its direction
        while it keeps paying; None when no neighbour beats it (or time is up)."""
        for dim, direction, neighbour in self._ordered_neighbours(current):
            if self.excluded(neighbour):
                continue
            if not self.tried(neighbour) and self._search_measure(neighbour) is None:
                return None
            if not self.better(neighbour, current):
                measured = self.mean(neighbour) is not None
                # The first worker only moves the loading out of the trainer: at best as fast
                # as none, and slower by the hand-over when it competes with the trainer for
                # a CPU. Two are the first that load in parallel, so they are always looked at.
                first_worker = current.num_workers == 0 and direction > 0
                worse = measured and self.worse(neighbour, current) and not first_worker
                if dim != "num_workers" or worse:
                    continue
                # Workers can sit on a plateau (one worker no faster than none), or one count
                # can fail on its own: look one step past a level or failed one.
                beyond = self.space.step(neighbour, dim, direction)
                if beyond is None or self.excluded(beyond):
                    continue
                if not self.tried(beyond) and self._search_measure(beyond) is None:
                    return None
                if not self.better(beyond, current):
                    continue
                neighbour = beyond
            best = neighbour
            while True:
                nxt = self.space.step(best, dim, direction)
                if nxt is None or self.excluded(nxt):
                    break
                if not self.tried(nxt) and self._search_measure(nxt) is None:
                    break
                if not self.better(nxt, best):
                    break
                best = nxt
            return best
        return None

    def _ordered_neighbours(self, config: Config) -> list[tuple[str, int, Config]]:
        share = self._data_wait_share(config)
        more_workers_first = share is None or share > DATA_BOUND_SHARE
        order = {
            "num_workers": 0,
            "num_threads": 1,
            "prefetch_factor": 2,
            "persistent_workers": 3,
            "pin_memory": 4,
        }

        def key(item: tuple[str, int, Config]) -> tuple[int, int]:
            dim, direction, _ = item
            if dim == "num_workers":
                first = 1 if more_workers_first else -1
            elif dim == "num_threads":
                first = -1  # oversubscription is the usual problem, and fewer is cheaper
            else:
                first = 1
            return order[dim], 0 if direction == first else 1

        return sorted(self.space.neighbours(config), key=key)

    def _data_wait_share(self, config: Config) -> float | None:
        shares = [
            m.data_wait_share
            for m in self.trials
            if m.ok and m.config == config and m.data_wait_share is not None
        ]
        return statistics.fmean(shares) if shares else None

    def _best_config(self) -> Config:
        measured = {m.config for m in self.trials if m.ok}
        return max(measured, key=lambda c: self.mean(c) or 0.0)

    def _finalists(self) -> list[Config]:
        """The fastest configurations that the noise cannot tell apart, best first."""
        measured = {m.config for m in self.trials if m.ok}
        if not measured:
            return []
        ranked = sorted(measured, key=lambda c: self.mean(c), reverse=True)
        floor = self.mean(ranked[0]) / (1 + self.climb_noise)
        return [c for c in ranked if self.mean(c) >= floor][:FINALISTS]

    def noise_among(self, configs: Iterable[Config]) -> float:
        """Noise from the repeated runs of ``configs`` alone.

        Noise differs between configurations: an oversubscribed one swings with every other
        process on the machine, a calm one barely moves. Deciding between calm finalists
        with the swings of another configuration would call every difference noise.
        """
        chosen = set(configs)
        runs = [m for m in self.trials if m.config in chosen]
        if not any(self.count(c) > 1 for c in chosen):
            return self.noise
        return estimate_noise(runs, self.noise_floor)

    def _finalist_noise(self) -> float:
        repeated = [c for c in self._finalists() if self.count(c) > 1]
        return self.noise_among(repeated) if repeated else self.noise

    def choose(self) -> Config | None:
        """The pick: the original when it is within noise of the best (no change is a valid
        answer), else the cheapest configuration within noise of the best.

        The best is the fastest finalist measured more than once, and the noise is theirs;
        without repeated finalists, the fastest of all with the noise of every repeated run.
        """
        measured = {m.config for m in self.trials if m.ok}
        if not measured:
            return None
        repeated = [c for c in self._finalists() if self.count(c) > 1]
        if repeated:
            best, noise = max(self.mean(c) for c in repeated), self._finalist_noise()
        else:
            best, noise = max(self.mean(c) for c in measured), self.noise
        within = [c for c in measured if self.mean(c) >= best / (1 + noise)]
        if self.original in within:
            return self.original
        return min(within, key=lambda c: c.cost)

    def _confirm(self) -> Config | None:
        """Re-run the pick when measured only once (the best of many noisy runs is flattered
        by luck). When the noise is above its floor, re-run every finalist first: their own
        repeats may show them calmer than the configurations that set the noise."""
        for config in self._finalists() if self.noise > self.noise_floor else []:
            if self.stopped:
                break
            if self.count(config) < 2 and self._search_measure(config, "confirm") is None:
                break
        for _ in range(3):
            pick = self.choose()
            if pick is None or self.count(pick) > 1 or self.stopped:
                return pick
            if self._search_measure(pick, "confirm") is None:
                break
        return self.choose()

    # -- verification -------------------------------------------------------------------------

    def verify(self, candidate: Config) -> Verification:
        """A B A B ... runs of the original (A) and ``candidate`` (B), as many pairs as the
        budget allows (up to ``verify_pairs``); the gain is confirmed only if every pair
        shows it and their mean is beyond the noise."""
        estimate = self._pair_estimate(candidate)
        pairs = self.limits.verify_pairs
        if estimate > 0 and math.isfinite(self.remaining()):
            pairs = min(pairs, int(self.remaining() // estimate))
        a_runs: list[float] = []
        b_runs: list[float] = []
        a_steps: list[list[float]] = []
        b_steps: list[list[float]] = []
        ratios: list[float] = []
        reason = ""
        for _ in range(pairs):
            a = self._measure(self.original, "verify-original")
            if not a.ok:
                reason = f"a run of the original settings did not complete ({a.reason})"
                break
            b = self._measure(candidate, "verify-tuned")
            if not b.ok:
                reason = f"a run of the tuned settings did not complete ({b.reason})"
                break
            a_runs.append(a.throughput)
            b_runs.append(b.throughput)
            a_steps.append(a.step_s)
            b_steps.append(b.step_s)
            ratios.append(_pair_ratio(a, b))
        noise = self.noise_among([self.original, candidate])
        # The gain is compare's figure (the one definition of "x faster" the tool prints) over
        # the steps of all pairs; where the trials kept no step times, the mean pair ratio.
        interval = None
        if ratios and all(a_steps) and all(b_steps):
            interval = speedup(
                [s for run in a_steps for s in run], [s for run in b_steps for s in run]
            )
            if not math.isfinite(interval.estimate):
                interval = None
        gain = interval.estimate if interval is not None else statistics.fmean(ratios or [0.0])
        # Confirmed: every pair shows the gain, the gain is beyond the noise between runs
        # (which the interval, made within runs, does not see), and compare would call it
        # faster (the interval clear of its practical band).
        confirmed = len(ratios) >= 2 and min(ratios) > 1.0 and gain > 1.0 + noise
        if interval is not None:
            ratio = Interval(1 / interval.estimate, 1 / interval.high, 1 / interval.low)
            confirmed = confirmed and verdict_of(ratio) == FASTER
        if not reason:
            if len(ratios) < 2:
                reason = "the budget left room for fewer than 2 verification pairs"
            elif not confirmed:
                reason = (
                    f"the gain did not hold: pair ratios {', '.join(f'{r:.2f}' for r in ratios)} "
                    f"(noise {noise:.0%})"
                )
        return Verification(a_runs, b_runs, ratios, confirmed, reason, interval)

    # -- result -------------------------------------------------------------------------------

    def _result(
        self,
        candidate: Config | None,
        verification: Verification | None,
        *,
        stopped: str | None = None,
        search_s: float | None = None,
    ) -> TuneResult:
        recommended = self.original
        if candidate is not None and verification is not None and verification.confirmed:
            recommended = candidate
        elapsed = self.clock() - self._started
        return TuneResult(
            original=self.original,
            recommended=recommended,
            candidate=candidate,
            trials=self.trials,
            noise=self.noise,
            verification=verification,
            stopped=stopped or self.stopped or "converged",
            elapsed_s=elapsed,
            search_s=elapsed if search_s is None else search_s,
            budget_s=None,
            explores=[d for d in DIMENSIONS if len(self.space.values(d)) > 1],
        )


def _pair_ratio(a: Measurement, b: Measurement) -> float:
    """How many times faster run ``b`` is than run ``a``: compare's figure of each run (the
    median of its block means, torchdoctor.compare.stats.typical_step) where both kept their
    step times, else their throughputs."""
    if a.step_s and b.step_s:
        tb = typical_step(b.step_s)
        if tb > 0:
            return typical_step(a.step_s) / tb
    return b.throughput / a.throughput


__all__ = ["OK", "Search", "SearchLimits", "estimate_noise"]
