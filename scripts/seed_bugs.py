"""Seeds known bugs into the agents' paths, one at a time, and checks that a test fails for each.

Issue #40 asks that every seeded bug in the pause paths fail a test: a lease never released, a prefetch at the
wrong time, a hint's session mixed with another's, a wrong quantile. Each entry of BUGS is one such bug, as an
exact replacement in one file; the script applies it, runs the agents' tests (AGENT_TESTS, about 40 s on two
cores), puts the file back, and says which test caught it; the tests must pass first, without a bug. It exits
1 when a bug survives. It is not part of scripts/test.sh (fifteen runs of the agents' tests): run it after changing
these paths.

    .venv/bin/python scripts/seed_bugs.py [index ...]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PAUSES = "kvcopy/integrations/vllm/agents/pauses.py"
AGENT_TESTS = ("tests/agents", "tests/integrations/test_vllm_agents.py", "tests/integrations/test_vllm_leases.py")


class Bug(NamedTuple):
    name: str
    path: str
    correct: str  # must occur exactly once in the file
    seeded: str


BUGS = (
    Bug(
        "a lease never released (the policy keeps it)",
        "kvcopy/integrations/vllm/agents/leases.py",
        "lease = self._leases.pop(session, None)",
        "lease = self._leases.get(session)",
    ),
    Bug(
        "a lease not released at its session's resume",
        PAUSES,
        "        self.policy.release(session)\n        prefetch = self._prefetches.pop(session, None)\n        planned",
        "        prefetch = self._prefetches.pop(session, None)\n        planned",
    ),
    Bug("a prefetch started at once", PAUSES, "if prefetch.started or prefetch.due > now:", "if prefetch.started:"),
    Bug(
        "a prefetch started late",
        PAUSES,
        "since + plan.prefetch_at_s, since",
        "since + 3 * plan.prefetch_at_s, since",
    ),
    Bug(
        "a resume taken for another session's",
        "kvcopy/agents/sessions.py",
        "pause = self._paused.get(session)",
        "pause = next(iter(self._paused.values()), None)",
    ),
    Bug(
        "a gap learned under another session",
        "kvcopy/agents/sessions.py",
        "gap, session=pause.session, tool=pause.tool",
        "gap, session=pause.request_id, tool=pause.tool",
    ),
    Bug(
        "a resume that came before its pause waited for",
        "kvcopy/agents/sessions.py",
        "ahead = self._ahead_of(session if hint is not None else None, last_key)",
        "ahead = None",
    ),
    Bug(
        "a lease charged for the time LRU keeps the chunks anyway",
        "kvcopy/agents/plan.py",
        "held = np.minimum(g[None, :], leases[:, None]) - lru",
        "held = np.minimum(g[None, :], leases[:, None]) - 0.0",
    ),
    Bug(
        "holding priced at nothing before the tier's reuse is measured",
        PAUSES,
        "if self.policy.evicted < capacity:",
        "if self.policy.evicted < 0:",
    ),
    Bug(
        "a read back charged for the time LRU keeps it anyway",
        "kvcopy/agents/plan.py",
        "held = price * np.maximum(np.minimum(gg, cap) - p - lru, 0.0)",
        "held = price * np.maximum(np.minimum(gg, cap) - p, 0.0)",
    ),
    Bug(
        "a pause planned as it begins, whatever the delay",
        PAUSES,
        "delay = min(self.plan_delay_s, half_lru)",
        "delay = 0.0",
    ),
    Bug(
        "one request's hint read for another's",
        PAUSES,
        "if context.req_id in self._hints:\n            return self._hints[context.req_id]",
        "if self._hints:\n            return next(reversed(self._hints.values()))",
    ),
    Bug(
        "a quantile taken too high",
        "kvcopy/agents/gap_forecast.py",
        "return np.exp(self._log_quantiles(np.asarray(qs, dtype=np.float64)))",
        "return np.exp(self._log_quantiles(np.minimum(0.999, np.asarray(qs, dtype=np.float64) * 1.2)))",
    ),
    Bug(
        "a quantile taken mirrored (1 - q)",
        "kvcopy/agents/gap_forecast.py",
        "return np.exp(self._log_quantiles(np.asarray(qs, dtype=np.float64)))",
        "return np.exp(self._log_quantiles(1 - np.asarray(qs, dtype=np.float64)))",
    ),
)


def failing_tests() -> list[str]:
    """The agents' tests that fail as the tree is now (the first, with -x), or pytest's exit status when it
    failed without naming a test (a collection or usage error: no bug is caught by that)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *AGENT_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    failed = [line.split()[1] for line in run.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if run.returncode not in (0, 1) or (run.returncode == 1 and not failed):
        raise SystemExit(f"pytest ended with status {run.returncode} without a failing test:\n{run.stdout[-2000:]}")
    return failed


def caught_by(bug: Bug) -> list[str]:
    """The tests that fail with ``bug`` seeded (empty: it survived)."""
    path = ROOT / bug.path
    text = path.read_text()
    if text.count(bug.correct) != 1:
        raise SystemExit(f"{bug.name}: {bug.path} no longer holds its line once; update BUGS")
    path.write_text(text.replace(bug.correct, bug.seeded))
    try:
        return failing_tests()
    finally:
        path.write_text(text)


def main(argv: list[str]) -> int:
    chosen = [int(a) for a in argv] or range(len(BUGS))
    already = failing_tests()
    if already:  # (then every seeded bug would look caught)
        raise SystemExit(f"the agents' tests fail without a seeded bug: {already[0]}")
    survived = 0
    for i in chosen:
        failed = caught_by(BUGS[i])
        survived += not failed
        print(f"{i} {BUGS[i].name}: " + (f"caught by {failed[0]}" if failed else "SURVIVED"), flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
