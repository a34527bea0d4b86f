"""When to speculate, and with how many draft tokens: measured, per batch size.

Speculation pays when a round delivers more tokens per second than plain decoding:

    rate(plain) = 1 / t_plain(b)            rate(k) = tokens_per_row(k) / t_round(b, k)

where ``b`` is the batch size rounded up to a power of two. The times are the median of the
last few measured steps of that option at that size (a plain decode step, or a whole round:
draft + verify + accept + bookkeeping): a step that the OS or another process interrupted
must not flip the decision.

The tokens per row of a round of k drafts come from one acceptance model shared by every k
and every batch size (``_Acceptance``): for each draft position j, the share of rows that
kept draft j among those that reached it (kept drafts 1..j-1), so

    tokens_per_row(k) = 1 + sum_{j<=k} p_1 * ... * p_j

Acceptance depends on the draft and the policy, not on k or the batch: draft j is proposed
and judged the same way whatever comes after it. So a round of k = 4 informs the estimate of
k = 1, 2 and 3 too, and each estimate rests on every round the engine ran. Per position,
because acceptance falls with the position (one per-token α overrates long rounds). The
rule once kept a separate mean of each option's own rounds: at batch 1 a round's yield is
nearly bimodal (every draft rejected, or most kept), and the ~10 rounds an option had were
too few: at batch 1 it underrated k = 4 and chose plain decoding or k = 1 where always
speculating was faster. (Earlier still it took the median of per-round rates, which
read one token per round at batch 1.) The model forgets at a rate counted in rows
(``ACCEPT_MEMORY``), so a batch of 64 refreshes it in a round or two and a batch of 1 in
tens of rounds; a trial (rule 4) of a speculative option shrinks the old counts, so the
trial's own rounds decide. α (one acceptance probability over all positions) is still
reported.

The rule:

1. never speculate above ``--speculative-max-batch-size`` (0 = no cap);
2. without ``--speculative-adaptive``: always a round of ``k = --speculative-num-steps``;
3. otherwise, at each batch size, first measure every option (plain, k = 1..k_max) 3 times;
   then take the option with the best measured rate (staying with the current one unless
   another is ≥ 5% faster: a switch costs a drain and a draft catch-up, and two options
   within noise of each other must not alternate); every ``--speculative-probe-interval``
   steps run the least recently measured option once, so a draft that improves (online
   training) or a policy that drifts away from it is noticed. A probe after which the rule
   keeps its choice doubles that batch size's interval (up to ``MAX_BACKOFF``×); one that
   changes the choice resets it. A probe is a switch and back, which costs a large batch a
   visible share of its steps without the back-off.
4. a probe measured ≥ 5% faster than the choice starts a *trial*: the probed option's older
   measurements are dropped and it runs for ``WARMUP`` - 1 more steps, so the rule compares
   two fresh medians. Without it, the old measurements outvoted the probe: an option
   measured while the engine was cold (its first steps, graph captures, shorter contexts)
   kept its stale median for several probe intervals — hundreds of steps — while the rule
   ran a slower option (on the CPU at batch 8: k = 1 chosen at 0.69× plain, whose steps
   it had measured at 294 tokens/s per row during the warm-up and at 564 by a probe). The
   probe alone can also be off the other way: a plain step between rounds has no earlier
   step in flight, so its time ends at the launch, without the device work (with overlap,
   a plain step's time is launching it plus finishing the one before). The trial's two
   further steps are timed whole, and the median of the three sets the time.

Why this shape: where decode is memory-bound (small batches) a verify step of k + 1 tokens
per row costs about one plain step, so any decent acceptance wins; as the batch grows the
step becomes compute-bound, a verify costs up to (k + 1)× a plain step and the measured
rates switch speculation off by itself — as they do when acceptance is low (a draft the
policy has moved away from) or when the draft is expensive relative to the policy (tiny CPU
models, where per-op overhead makes a draft step cost a sizable fraction of a policy step).
Everything is measured on the running engine, so no device model is assumed; the cost is a
few exploratory steps per batch size.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

from miles.engines.spec.config import SpeculativeConfig

WARMUP = 3  # measurements of each option before the rule trusts them
SWITCH_GAIN = 0.05  # leave the current option only for one predicted this much faster
WINDOW = 9  # recent step times per option whose median the rule uses
YIELD_DECAY = 0.9  # per-measurement decay of plain steps' tokens-per-row mean
DECAY = 0.98  # per-round decay of the reported α's counts
ACCEPT_MEMORY = 64  # rows the acceptance model remembers (its counts decay by 1 - 1/64 per row)
ACCEPT_PRIOR = 2.0  # rows' worth of prior per position: p_1 ~ 0.5, p_j ~ p_{j-1}
TRIAL_KEEP = 0.1  # the share of the acceptance counts a speculative trial keeps
MAX_BACKOFF = 16  # the longest probe interval, in --speculative-probe-interval units


def bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class VersionStats:
    rounds: int = 0  # row-rounds (each request in each verify step)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "spec/accept_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec/accept_len": self.emitted / self.rounds if self.rounds else 0.0,
            "spec/rounds": float(self.rounds),
            "spec/drafted": float(self.drafted),
            "spec/accepted": float(self.accepted),
        }


@dataclass
class _Rates:
    """Recent measurements of each (batch bucket, option): step times (their median) and the
    tokens each row emitted (a decayed mean: ``YIELD_DECAY``; the rule uses it for plain
    steps and for a probe's own rate, and ``_Acceptance`` for a round's expected yield)."""

    seconds: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    emitted: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # decayed (tokens, rows)
    latest: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # the last step's
    count: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    last: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, key: tuple[int, int], seconds: float, tokens: int, rows: int, step: int) -> None:
        self.seconds.setdefault(key, deque(maxlen=WINDOW)).append(max(seconds, 1e-9))
        t, r = self.emitted.get(key, (0.0, 0.0))
        self.emitted[key] = (YIELD_DECAY * t + tokens, YIELD_DECAY * r + max(rows, 1))
        self.latest[key] = (float(tokens), float(max(rows, 1)))
        self.count[key] += 1
        self.last[key] = step

    def per_row(self, key: tuple[int, int]) -> float:
        t, r = self.emitted.get(key, (0.0, 0.0))
        return t / r if r else 0.0

    def rate(self, key: tuple[int, int]) -> float | None:
        """Tokens per second per row: the mean yield over the median step time."""
        window = self.seconds.get(key)
        return self.per_row(key) / statistics.median(window) if window else None

    def last_rate(self, key: tuple[int, int]) -> float | None:
        """The latest step's own rate (a probe's: its yield over its time)."""
        window = self.seconds.get(key)
        if not window:
            return None
        tokens, rows = self.latest[key]
        return tokens / rows / window[-1]

    def restart(self, key: tuple[int, int]) -> None:
        """Keep only the latest step (a trial: rule 4): older times may come from a cold
        engine, older yields from a draft that has trained since."""
        self.seconds[key] = deque([self.seconds[key][-1]], maxlen=WINDOW)
        self.emitted[key] = self.latest[key]


class _Acceptance:
    """Decayed counts, per draft position j = 1..k_max, of rows that reached draft j and of
    rows that kept it; ``tokens(k)`` is the expected yield of a round of k drafts."""

    def __init__(self, k_max: int) -> None:
        self.reach = [0.0] * (k_max + 1)  # index 0 unused
        self.kept = [0.0] * (k_max + 1)
        self._yields: list[float] | None = None  # tokens(k) for k = 0..k_max

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        """``outcomes``: per row (drafts it could keep, drafts it kept)."""
        keep = (1.0 - 1.0 / ACCEPT_MEMORY) ** len(outcomes)
        self.reach = [keep * x for x in self.reach]
        self.kept = [keep * x for x in self.kept]
        for drafts, kept in outcomes:
            for j in range(1, min(kept + 1, drafts, len(self.reach) - 1) + 1):
                self.reach[j] += 1.0
                self.kept[j] += j <= kept
        self._yields = None

    def shrink(self, share: float) -> None:
        self.reach = [share * x for x in self.reach]
        self.kept = [share * x for x in self.kept]
        self._yields = None

    def probs(self) -> list[float]:
        out, prior = [], 0.5
        for j in range(1, len(self.reach)):
            prior = (self.kept[j] + ACCEPT_PRIOR * prior) / (self.reach[j] + ACCEPT_PRIOR)
            out.append(prior)
        return out

    def tokens(self, k: int) -> float:
        """Expected tokens per row of a round of k drafts (the rule asks for every k at
        every step: computed once per change of the counts)."""
        if self._yields is None:
            total, run, self._yields = 1.0, 1.0, [1.0]
            for p in self.probs():
                run *= p
                total += run
                self._yields.append(total)
        return self._yields[min(k, len(self._yields) - 1)]


class SpecController:
    """Picks plain decoding (0) or a round of k drafts for each engine step."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.k_max = cfg.speculative_num_steps
        self.adaptive = cfg.speculative_adaptive
        self.cap = cfg.speculative_max_batch_size
        self.probe = cfg.speculative_probe_interval
        self.rates = _Rates()
        self.accept = _Acceptance(max(self.k_max, 1))
        self.acc, self.rej = 1.0, 1.0  # decayed counts (a weak prior of α = 0.5)
        self.steps = 0
        self.by_version: dict[int, VersionStats] = defaultdict(VersionStats)
        self.spec_tokens = self.plain_tokens = 0
        self.spec_s = self.plain_s = 0.0
        self.chosen: dict[int, int] = defaultdict(int)
        self.current: dict[int, int] = {}  # the option the rule settled on, per batch bucket
        self.interval: dict[int, int] = {}  # steps between probes, per batch bucket (backs off)
        self.next_probe: dict[int, int] = {}  # the step of the next probe, per batch bucket
        self.probed: dict[int, int] = {}  # batch bucket → the option its last step probed
        self.trial: dict[int, list[int]] = {}  # batch bucket → [option, steps left] (rule 4)
        self.trials = 0
        self.probes = 0
        self.is_probe = False  # whether the last choice was a probe (rule 3)

    @property
    def alpha(self) -> float:
        return self.acc / (self.acc + self.rej)

    def options(self) -> list[int]:
        return [0, *range(1, self.k_max + 1)] if self.adaptive else [self.k_max]

    def choose(self, batch: int) -> int:
        self.steps += 1
        self.is_probe = False
        k = self._choose(batch)
        self.chosen[k] += 1
        return k

    def _choose(self, batch: int) -> int:
        if self.cap and batch > self.cap:
            return 0
        if not self.adaptive:
            return self.k_max
        b, t = bucket(batch), self.rates
        opts = self.options()
        for o in opts:
            if t.count[(b, o)] < WARMUP:
                return o
        if b in self.trial:
            return self._choose_trial(b)
        interval = self.interval.setdefault(b, self.probe)
        if self.steps >= self.next_probe.setdefault(b, self.steps + interval):
            self.next_probe[b] = self.steps + interval
            self.probes += 1
            self.is_probe = True
            self.probed[b] = option = min(opts, key=lambda o: t.last[(b, o)])
            return option
        best = max(opts, key=lambda o: self.rate(b, o))
        current = self.current.get(b)
        if current is not None and self.rate(b, best) < (1 + SWITCH_GAIN) * self.rate(b, current):
            best = current  # a switch costs a drain and a draft catch-up: not for noise
        if b in self.probed:  # the first choice after a probe: did it change anything?
            probed = self.probed.pop(b)
            probe_rate = t.last_rate((b, probed))  # its own yield: a shift the model has not seen yet
            if probe_rate is not None and probed != best and probe_rate >= (1 + SWITCH_GAIN) * self.rate(b, best):
                # the probe alone beat the choice: a trial of fresh measurements (rule 4)
                t.restart((b, probed))
                if probed:
                    self.accept.shrink(TRIAL_KEEP)
                self.trial[b] = [probed, WARMUP - 1]
                self.trials += 1
                return self._choose_trial(b)
            kept = best == current
            self.interval[b] = min(2 * interval, MAX_BACKOFF * self.probe) if kept else self.probe
            self.next_probe[b] = self.steps + self.interval[b]
        self.current[b] = best
        return best

    def _choose_trial(self, b: int) -> int:
        option, left = self.trial[b]
        if left > 1:
            self.trial[b][1] -= 1
        else:
            del self.trial[b]
        self.interval[b] = self.probe  # whatever the trial finds, look again soon
        self.next_probe[b] = self.steps + self.probe
        return option

    def rate(self, b: int, option: int) -> float:
        """Tokens per second per row of ``option`` at batch bucket ``b`` (0: unmeasured): a
        plain step's measured yield, or a round's expected one, over the median step time."""
        if not option:
            return self.rates.rate((b, 0)) or 0.0
        seconds = self.step_seconds(b, option)
        return self.accept.tokens(option) / seconds if seconds else 0.0

    def step_seconds(self, b: int, option: int) -> float:
        """The median measured step time of ``option`` at batch bucket ``b`` (0: unmeasured)."""
        window = self.rates.seconds.get((b, option))
        return statistics.median(window) if window else 0.0

    def observe_plain(self, batch: int, seconds: float, tokens: int) -> None:
        self.rates.add((bucket(batch), 0), seconds, tokens, batch, self.steps)
        self.plain_tokens += tokens
        self.plain_s += seconds

    def observe_round(self, batch: int, k: int, seconds: float | None, version: int,
                      outcomes: list[tuple[int, int]], emitted: int) -> None:
        """A round of ``k`` drafts over ``batch`` rows took ``seconds`` (None: an untimed
        eager probe, whose acceptance counts but not its time); ``outcomes`` per row:
        (drafts it could keep, drafts it kept); ``emitted``: tokens appended in all."""
        rows = len(outcomes)
        drafted = sum(d for d, _ in outcomes)
        accepted = sum(a for _, a in outcomes)
        rejections = sum(a < d for d, a in outcomes)
        self.accept.observe(outcomes)
        b = bucket(batch)
        if seconds is None:
            self.rates.last[(b, k)] = self.steps  # probed: the next probe samples another option
            self.probed.pop(b, None)  # no time to judge it by: no trial, no back-off change
        else:
            self.rates.add((b, k), seconds, emitted, rows, self.steps)
            self.spec_tokens += emitted
            self.spec_s += seconds
        self.acc = DECAY * self.acc + accepted
        self.rej = DECAY * self.rej + rejections
        vs = self.by_version[version]
        vs.rounds += rows
        vs.drafted += drafted
        vs.accepted += accepted
        vs.emitted += emitted

    def stats(self, version: int) -> dict[str, float]:
        out = self.by_version[version].as_dict() if version in self.by_version else VersionStats().as_dict()
        total = VersionStats()
        for vs in self.by_version.values():
            total.rounds += vs.rounds
            total.drafted += vs.drafted
            total.accepted += vs.accepted
            total.emitted += vs.emitted
        tot = total.as_dict()
        steps = max(sum(self.chosen.values()), 1)
        out.update({
            "spec/accept_rate_total": tot["spec/accept_rate"],
            "spec/accept_len_total": tot["spec/accept_len"],
            "spec/alpha": self.alpha,
            **{f"spec/expected_tokens_k{k}": self.accept.tokens(k) for k in range(1, self.k_max + 1)},
            "spec/spec_step_frac": 1.0 - self.chosen[0] / steps,
            "spec/k_mean": sum(k * c for k, c in self.chosen.items()) / steps,
            "spec/probes": float(self.probes),
            "spec/trials": float(self.trials),
            "spec/tokens_per_s_spec": self.spec_tokens / self.spec_s if self.spec_s else 0.0,
            "spec/tokens_per_s_plain": self.plain_tokens / self.plain_s if self.plain_s else 0.0,
        })
        return out
