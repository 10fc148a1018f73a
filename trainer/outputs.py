"""What a run writes while it trains, as the stage's set-up hands it to its loop; the run's start from where its
resume checkpoint left off, and its end."""
from dataclasses import dataclass

from dataset.training_data import warn_truncated
from trainer.checkpointer import Checkpointer
from trainer.distributed import leave_together
from trainer.metrics import MetricsLog, Throughput
from trainer.previews import Previews
from trainer.resume import resume_lines
from trainer.startup import log_peak
from trainer.trainer_utils import run_line, stop_message


@dataclass(frozen=True)
class Outputs:
    """A run's log and metrics (MetricsLog), its sample grids and validation loss (Previews), its resume checkpoint
    (Checkpointer, holding the position and the named objects) and what other tools read (`export`:
    model/weights.WeightsExport or model/model_lora.LoRAExport), and the FLOPs and peak its MFU is counted from
    (metrics.Throughput)."""
    metrics: MetricsLog
    previews: Previews
    checkpointer: Checkpointer
    export: object
    throughput: Throughput


def resume_run(saved, out, stage, parameters, info):
    """Start the run where `saved` (the resume checkpoint, or None: a fresh run) left off: checked against the run
    (resume.check_resume: a misfit is one line), the position and every named object restored; then the lines
    that say so and what trains (`parameters`, of `stage`), and the metrics opened from that step (rows past it
    dropped, wandb's run continued)."""
    position, checkpointer = out.checkpointer.position, out.checkpointer
    notes = resume_lines(saved, checkpointer.spec, position, checkpointer.stem)
    checkpointer.restore(saved)
    for line in notes + [run_line(stage, parameters, position, info)]:
        out.metrics.log(line)
    out.metrics.open(position.step, position.step + position.steps_left, saved is not None)


def finish_run(out, components, info, stopped, received):
    """The run's end: the progress bar and wandb closed, the data loader let go, every process waiting for the
    others (rank 0 may still be writing), the captions CLIP cut short counted, and the last line: where the output
    is, or, for a run a stop signal ended (`stopped`; `received`: this process's signal, None if another's), how to
    continue it."""
    out.metrics.close()
    out.checkpointer.position.close()
    leave_together(info)
    log_peak(info, "the run", out.metrics.log)
    warn_truncated(components, info, out.metrics.log)
    position = out.checkpointer.position
    out.metrics.log(stop_message(received, position.step) if stopped else
                    f"done: {out.export.output} (step {position.step})")
