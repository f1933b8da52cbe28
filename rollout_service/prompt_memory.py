"""Per-prompt memory of uniform groups: prompts the model always solves, or never does, are skipped
for a while, so dynamic sampling (``learner.group_filter``) costs less generation.

Design: sans-IO, one ``PromptMemory`` per rollout server (``rollout_server.prompt_memory``). After
each group it judges the group by the learner's rule and metric (``common.group_rule``,
``algorithm.filter_groups.metric``): uniform (every episode passed, or every one failed) or not.
A prompt (a row's global index, stable across epochs) whose last ``last_k`` groups were all
uniform is skipped in the next ``skip_epochs`` epochs: the server marks it done without running
it, so it takes no grant and no generation. Then it runs again with a clean record: the model has
moved, and a prompt it could not solve may have become one it can learn from. A group with a
verdict the rule cannot give (a metric missing) or a mixed one clears the record.

Only prompts of this server's shard are remembered, and the memory lives as long as the server:
a restarted server learns again (skipping is an optimisation; forgetting costs generation, never
correctness). Mixed data sets (``data.datasets``) are refused with it: their batches hold exact
counts per source, and a skipped slot would break them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.group_rule import judge
from protocol.trajectory import Trajectory


@dataclass
class PromptMemory:
    last_k: int  # uniform groups in a row that get a prompt skipped (0: never)
    skip_epochs: int = 1
    metric: str = "reward"
    _streak: dict[int, int] = field(default_factory=dict)  # row index -> uniform groups in a row
    _until: dict[int, int] = field(default_factory=dict)  # row index -> last epoch it is skipped
    skipped: int = 0  # prompts skipped so far

    @property
    def enabled(self) -> bool:
        return self.last_k > 0

    def record(self, index: int, epoch: int, trajectories: Sequence[Trajectory]) -> bool:
        """The group of row ``index`` in ``epoch`` finished; True when the row is now skipped."""
        if not self.enabled:
            return False
        if judge(trajectories, self.metric) is not False:
            self._streak.pop(index, None)
            return False
        streak = self._streak.get(index, 0) + 1
        if streak < self.last_k:
            self._streak[index] = streak
            return False
        self._streak.pop(index, None)
        self._until[index] = epoch + self.skip_epochs
        return True

    def skips(self, index: int, epoch: int) -> bool:
        """Whether row ``index`` is skipped in ``epoch`` (then counted in ``skipped``)."""
        until = self._until.get(index)
        if until is None:
            return False
        if epoch > until:
            del self._until[index]
            return False
        self.skipped += 1
        return True

    @property
    def resting(self) -> int:
        """Prompts currently set to be skipped."""
        return len(self._until)
