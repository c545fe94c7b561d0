"""FSDPMemTracker with its per-op peak bookkeeping indexed by the modules that are running.

After every op, `MemTracker._update_peak_stats` (the reference, torch 2.13) walks every tracked
FSDP module (m3: ~150) and updates those whose name is in the ModTracker's `parents` (the few
running now). `PlanMemTracker` visits only those: the same updates, each module's independent of
the others', so the same peaks and snapshots (tests/mmtrain/test_plan.py compares the two).
"""

from __future__ import annotations

from copy import deepcopy

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY


class PlanMemTracker(FSDPMemTracker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._by_fqn: dict[str, object] = {}  # module name -> its stats (rebuilt when modules join)
        self._indexed = 0

    def _update_peak_stats(self, peak_state) -> None:
        curr_snap = self._curr_mem_snap
        if self._indexed != len(self.memory_tracking):
            self._by_fqn = {st.mod_fqn: st for st in self.memory_tracking.values()}
            self._indexed = len(self.memory_tracking)
        for fqn in self._mod_tracker.parents:
            mod_stats = self._by_fqn.get(fqn)
            if mod_stats is None or peak_state not in mod_stats.snapshots:
                continue
            for dev, dev_snap in curr_snap.items():
                if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                    mod_stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)
