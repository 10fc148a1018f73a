"""What a run shows of what it exports, while it trains: sample grids (out/samples/<run>_stepNNNNNN.png) and the
validation loss (eval/eval_loss.py's, on held-out images), both of the exported weights: the EMA swapped in while
they are drawn, if the run keeps one. Rank 0 alone, or every rank of a sharded run (each forward gathers the
shards), rank 0 writing.
"""
import contextlib
import os

from eval.eval_loss import heldout_losses
from eval.sampling import sample_images, save_grid


def grid_sampling(args):
    """How a stage's sample grids draw (eval.sampling.sample_images's settings): its --sample_* arguments."""
    return {"steps": args.sample_steps, "cfg": args.sample_cfg, "shift": args.sample_shift}


class Previews:
    """The sample grids (every --sample_interval steps and at the end) and the validation loss (every
    --val_interval steps and at the end) of `model` with `ema` swapped in (if any). `validation`: the held-out
    images, encoded (start_up's), or None."""

    def __init__(self, args, info, name, model, ema, components, prompts, sampling, prediction, precision,
                 validation, log):
        self.args, self.info, self.name, self.model, self.ema, self.log = args, info, name, model, ema, log
        self.components, self.prompts, self.sampling = components, prompts, sampling
        self.prediction, self.autocast, self.validation = prediction, precision.autocast, validation

    def exported_model(self):
        """A context giving the model as it is exported: with the EMA's weights while it lasts."""
        return self.ema.swapped_in(self.model) if self.ema else contextlib.nullcontext(self.model)

    def first(self, run, metrics):
        """A fresh run's step 0 (stages that start from trained weights): a grid of the starting weights, to compare
        with, and their validation loss, what a fine-tune must improve on."""
        if run.resumed:
            return
        self.draw(0)
        if self.validation:
            metrics.write_row({"step": 0, "epoch": 0, "val_loss": self.score(), "samples_seen": 0})

    def validate(self, run):
        """The validation loss when due, else None."""
        if self.validation and (run.step % self.args.val_interval == 0 or run.finished):
            return self.score()
        return None

    def grid(self, run):
        """A sample grid when due (not on a stop signal: the save comes first, and the run ends)."""
        interval = self.args.sample_interval
        if not run.stop and ((interval and run.step % interval == 0) or run.finished):
            self.draw(run.step)

    def score(self):
        """eval/eval_loss.py's mean over its fixed sigmas and noise, so the two agree on the same weights."""
        if not (self.info.is_main or self.info.sharded):
            return None
        with self.exported_model() as model:
            was_training = model.training
            model.eval()
            losses = heldout_losses(model, self.validation, self.prediction, self.args.seed, self.autocast)
            model.train(was_training)
        return sum(losses.values()) / len(losses)

    def draw(self, step):
        """The sample prompts with fixed noise, into out/samples/<run>_stepNNNNNN.png."""
        if not (self.info.is_main or self.info.sharded):
            return
        with self.exported_model() as model:
            images = sample_images(model, self.components, self.prompts, seed=self.args.seed, **self.sampling,
                                   resolution=self.args.resolution, device=self.info.device,
                                   prediction=self.prediction, autocast=self.autocast)
        if not self.info.is_main:
            return
        path = os.path.join(self.args.out_dir, "samples", f"{self.name}_step{step:06d}.png")
        save_grid(path, images, self.prompts)
        self.log(f"sample grid: {path}")
