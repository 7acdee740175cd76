"""The model of tests/test_reliability.py's shared engine. Worker processes import this module by name."""

from __future__ import annotations

from dsgd_test_models import Gate, KillCue, KillOnCue


class GatedKillOnCues(KillOnCue):
    """FixedDataMomentumNet whose worker 1 passes ``gate`` before each batch (as GatedWorker1Net's), fires
    ``build_cue`` as it builds this model and ``feed_cue`` as it feeds a batch (KillOnCue's "build" and "feed").

    Open gate and unarmed cues: FixedDataMomentumNet, so that one engine serves tests of each fault.
    """

    def __init__(self, worker_index: int, device_index: int, gate: Gate, build_cue: KillCue, feed_cue: KillCue):
        super().__init__(worker_index, device_index, cue=build_cue, at="build")
        self.cue, self.at = feed_cue, "feed"  # built: from now on, KillOnCue's "feed"
        self.gate = gate

    def get_feed_dict(self):
        if self.worker_index == 1:
            self.gate.pass_through()
        return super().get_feed_dict()
