"""What a run shows of the weights it exports, while it trains: sample grids (out/samples/<run>_stepNNNNNN.png) and
the validation loss (eval/eval_loss.py's, on held-out images), both with the EMA swapped in while they are drawn,
if the run keeps one. Rank 0 alone, or every rank of a sharded run (each forward gathers the shards), rank 0
writing.
"""
import contextlib

from eval.eval_loss import heldout_losses
from eval.sampling import sample_images, save_grid
from model.checkpoint import remove_leftovers


class Previews:
    """The grids and the validation loss of `model` with `ema` swapped in (if any), drawn as `sampler`
    (model/rectified_flow.Sampler) says from `seed`, the grids of `prompts` under the path `stem`
    (out/samples/<run>), the loss on `validation` (the held-out images, encoded: dataset/training_data's
    encode_heldout; or None). Rank 0 first deletes the temp files of a grid a killed run left half-written."""

    def __init__(self, model, ema, components, sampler, seed, info, stem):
        self.model, self.ema, self.components, self.sampler = model, ema, components, sampler
        self.seed, self.info, self.stem = seed, info, stem
        if info.is_main:
            remove_leftovers(stem)

    def exported_model(self):
        """A context giving the model as it is exported: with the EMA's weights while it lasts."""
        return self.ema.swapped_in(self.model) if self.ema else contextlib.nullcontext(self.model)

    def validation_loss(self, validation):
        """eval/eval_loss.py's mean over its fixed sigmas and noise on `validation`, so the two agree on the same
        weights (None on the ranks that do not score)."""
        if not (self.info.is_main or self.info.sharded):
            return None
        with self.exported_model() as model:
            was_training = model.training
            model.eval()
            losses = heldout_losses(model, validation, self.sampler.prediction, self.seed, self.sampler.autocast)
            model.train(was_training)
        return sum(losses.values()) / len(losses)

    def grid(self, step, prompts):
        """The prompts with fixed noise, into <stem>_stepNNNNNN.png -> its path (None on the ranks that do not
        write)."""
        if not (self.info.is_main or self.info.sharded):
            return None
        with self.exported_model() as model:
            images = sample_images(model, self.components, prompts, self.seed, self.sampler, self.info.device)
        if not self.info.is_main:
            return None
        path = f"{self.stem}_step{step:06d}.png"
        save_grid(path, images, prompts)
        return path


def step_zero(previews, metrics, data):
    """A fresh run's step 0, for a stage that starts from trained weights: their grid, and their validation loss as
    the metrics' first row (what the run must improve on). `data`: the run's StageData (its prompts, its validation
    images encoded)."""
    metrics.log(f"sample grid: {previews.grid(0, data.prompts)}")
    if data.validation:
        metrics.write_row({"step": 0, "epoch": 0, "val_loss": previews.validation_loss(data.validation),
                           "samples_seen": 0})
