"""What a run writes while it trains, as the stage's set-up hands it to its loop, and the run's start from where
its resume checkpoint left off."""
from dataclasses import dataclass

from trainer.checkpointer import Checkpointer
from trainer.metrics import MetricsLog
from trainer.previews import Previews
from trainer.resume import resume_lines
from trainer.trainer_utils import run_line


@dataclass(frozen=True)
class Outputs:
    """A run's log and metrics (MetricsLog), its sample grids and validation loss (Previews), its resume checkpoint
    (Checkpointer, holding the position and the named objects) and what other tools read (`export`:
    model/weights.WeightsExport or model/model_lora.LoRAExport)."""
    metrics: MetricsLog
    previews: Previews
    checkpointer: Checkpointer
    export: object


def resume_run(saved, out, stage, parameters, info):
    """Start the run where `saved` (the resume checkpoint, or None: a fresh run) left off: checked against the run
    (resume.check_resume: a misfit is one line), the position and every named object restored; then the lines
    that say so and what trains (`parameters`, of `stage`), and the metrics opened from that step."""
    position, checkpointer = out.checkpointer.position, out.checkpointer
    notes = resume_lines(saved, checkpointer.spec, position, checkpointer.stem)
    checkpointer.restore(saved)
    for line in notes + [run_line(stage, parameters, position, info)]:
        out.metrics.log(line)
    out.metrics.open(position.step, position.step + position.steps_left, saved is not None)
