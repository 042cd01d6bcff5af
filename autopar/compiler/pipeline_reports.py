"""What a pipelined module reports about its modeled step: the stage cut's simulated timeline, its
bubble beside (p-1)/(v*m), the Chrome trace and PNG of it, and the plan summary
(docs/pipeline.md#the-pipeline-timeline). A base of `PipelinedModule`."""

from __future__ import annotations

import os
from pathlib import Path

from autopar.core.pipeline_schedule import Schedule
from autopar.core.pipeline_simulate import Timeline, simulate
from autopar.planning.stage_result import StageCut
from autopar.reporting.pipeline_views import (
    PipelineTimelineReport,
    timeline_report,
    write_pipeline_chrome_trace,
    write_pipeline_png,
)


class PipelineReports:
    """The modeled step of a pipelined module with `schedule` and `stage_cut` (None: the user forced
    the cut and nothing priced it), and the stages' own plans (`stage_parallel` in `__dict__`)."""

    schedule: Schedule
    stage_cut: StageCut | None

    def _modeled(self) -> tuple[Timeline, str]:
        """The stage cut's simulated step (seconds), or the schedule at unit durations when the
        user forced the cut."""
        if self.stage_cut is not None:
            return self.stage_cut.timeline, "s"
        return simulate(self.schedule), "units"

    @property
    def timeline_report(self) -> PipelineTimelineReport:
        """The modeled step's bubble beside (p-1)/(v*m), busy time per stage and rank."""
        timeline, unit = self._modeled()
        return timeline_report(timeline, time_unit=unit)

    def write_pipeline_timeline(self, path: str | os.PathLike[str]) -> None:
        """pipeline.json (Chrome / Perfetto trace), pipeline.png and pipeline.txt in `path`."""
        where = Path(path)
        timeline, unit = self._modeled()
        write_pipeline_chrome_trace(where / "pipeline.json", timeline, time_unit=unit)
        write_pipeline_png(where / "pipeline.png", timeline, time_unit=unit)
        (where / "pipeline.txt").write_text(str(timeline_report(timeline, time_unit=unit)) + "\n")

    def plan_summary(self) -> str:
        """The schedule, the stage cut and the modeled timeline, then each of this rank's stages'
        own plan summary when tensor axes run inside them."""
        parts = [str(self.schedule).splitlines()[0]]
        if self.stage_cut is not None:
            parts.append(str(self.stage_cut))
        parts.append(str(self.timeline_report))
        for s, parallel in sorted(self.__dict__["stage_parallel"].items()):
            summary = getattr(parallel, "plan_summary", None)
            if callable(summary):
                parts.append(f"stage {s} on its sub-mesh:\n{summary()}")
        return "\n\n".join(parts)
