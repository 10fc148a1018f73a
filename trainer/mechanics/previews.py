"""What a run shows of the weights it exports, while it trains: sample grids (out/samples/<run>_stepNNNNNN.png) and
the validation loss (eval/eval_loss.py's, on held-out images), both with the EMA swapped in while they are drawn,
if the run keeps one. Rank 0 alone, or every rank of a sharded run (each forward gathers the shards), rank 0
writing.
"""
import contextlib
import time
from dataclasses import replace

from eval.eval_loss import heldout_losses
from eval.sampling import sample_images, save_grid
from model.checkpoint import remove_leftovers
from model.components import text_tokens
from model.memory import VAE_DECODE_VALUES, sampling_fit, sampling_room


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
            losses = heldout_losses(model, validation, self.sampler.prediction, self.seed, self.sampler.autocast,
                                    self.components)
            model.train(was_training)
        return sum(losses.values()) / len(losses)

    def grid(self, step, prompts):
        """The prompts with fixed noise, into <stem>_stepNNNNNN.png -> (its path, None on the ranks that do not
        write; how long it took and, with blocks swapped, how it fitted the card)."""
        if not (self.info.is_main or self.info.sharded):
            return None, ""
        started = time.perf_counter()
        with self.exported_model() as model, self.fitted(model, len(prompts)) as (sampler, how):
            images = sample_images(model, self.components, prompts, self.seed, sampler, self.info.device)
        took = f"{time.perf_counter() - started:.1f} s{how}"
        if not self.info.is_main:
            return None, took
        path = f"{self.stem}_step{step:06d}.png"
        save_grid(path, images, prompts)
        return path, took

    @contextlib.contextmanager
    def fitted(self, model, prompts):
        """The sampler, and the model's swapped blocks as a grid of `prompts` takes them: on a GPU, those the room
        left allows brought in for the grid (only the rest stream), and the prompts in parts where all at once
        would not fit; on a CPU streamed as in training. -> (sampler, what it says of that)."""
        swap = getattr(model, "block_swap", None)
        if swap is None or self.info.device.type != "cuda":
            yield self.sampler, ""
            return
        side = self.sampler.resolution // self.components.downscale
        tokens = (side // model.config.patch_size) ** 2 + text_tokens(self.components)
        decode = VAE_DECODE_VALUES * 2 * self.sampler.resolution ** 2 if self.components.spec["kind"] == "sd3" else 0
        room = sampling_room(self.info.device) - swap.buffers_needed()  # (the first grid: before any step made them)
        per_forward, streamed = sampling_fit(model.config, room, (swap.count, swap.block_bytes()), prompts, tokens,
                                             decode)
        with swap.streaming(streamed):
            yield replace(self.sampler, batch=per_forward), \
                f", {streamed} of {swap.count} swapped blocks streamed, {per_forward} prompt(s) a forward"


def step_zero(previews, metrics, data):
    """A fresh run's step 0, for a stage that starts from trained weights: their grid, and their validation loss as
    the metrics' first row (what the run must improve on). `data`: the run's StageData (its prompts, its validation
    images encoded)."""
    path, took = previews.grid(0, data.prompts)
    metrics.log(f"sample grid: {path} ({took})")
    if data.validation:
        metrics.write_row({"step": 0, "epoch": 0, "val_loss": previews.validation_loss(data.validation),
                           "samples_seen": 0})
