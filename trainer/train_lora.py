"""LoRA: train small low-rank adapters on a frozen model, e.g. to teach it one subject, style or word.

    python trainer/train_lora.py                      # the demo: teach out/pretrain_tiny the word "white"
    python trainer/train_lora.py --data my_images/ --lora_name mystyle --lora_rank 16
    python trainer/train_lora.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/
    torchrun --nproc_per_node 2 trainer/train_lora.py --data my_images/ --lora_targets attention,ff

The demo's data (`--data builtin:white`) is 40 built-in images whose objects are all white, a colour (and a
word) the pretrained model never saw, trained alongside 120 ordinary ones (`--prior_data`) so that what the model
drew before changes less. The adapters go to out/lora/lora_<name>_<preset>.safetensors in diffusers' LoRA
format (rank, alpha and targets in its metadata, plus which base weights they were trained on), sample grids
to out/samples/ (step 0 shows the base model), the resume checkpoint (only the adapters, their optimizer and
EMA) to checkpoints/lora_<name>_<preset>_resume.json. Sample with the adapter:

    python eval/eval_sample.py --lora demo --prompt "a large white star in the center"
"""
import argparse
import copy
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.image_folder import DatasetError  # noqa: E402
from model.model_lora import (  # noqa: E402
    TARGET_GROUPS, apply_lora, load_lora_state_dict, lora_state_dict, save_lora,
)
from trainer.trainer_utils import (  # noqa: E402
    Logger, UserError, add_training_args, init_distributed, load_start_weights, lora_file, lora_run_name, run_main,
    sample_prompts_for, train, training_dataset, weights_identity,
)


class LoRAAdapters:
    """What the LoRA stage trains, resumes and exports: only the adapters (diffusers' names), written to one
    safetensors file with the base weights' identity in its record. The same methods as trainer_utils.FullModel."""

    def __init__(self, path, base):
        self.path, self.base = path, base
        self.stem = path[:-len(".safetensors")]  # where a killed save's leftovers are looked for

    def identity(self):
        return {"kind": "lora", "base": self.base}  # a resume on other base weights would train something else

    def state(self, model):
        return lora_state_dict(model)

    def load_state(self, model, state):
        load_lora_state_dict(model, state)  # strict: names the keys that do not fit

    def with_state(self, model, state):
        sampler = copy.deepcopy(model)
        load_lora_state_dict(sampler, state)
        return sampler

    def export(self, step, model, state, components, record, dtype):
        return save_lora(model, self.path, {**record, "step": step, "base": self.base}, state=state,
                         dtype=dtype)["bytes"]

    def describe(self):
        return self.path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The demo: 40 white images + 120 prior ones, 30 epochs of 10 steps at batch 16 (300 steps, BENCHMARKS.md).
    # Adapters take a high learning rate; fp32 files, since they are small and diffusers applies them exactly;
    # no EMA over so few steps.
    add_training_args(parser, data="builtin:white", num_samples=40, learning_rate=2e-3, warmup_steps=10,
                      epochs=30, ema_decay=0.0, save_interval=100, sample_interval=0, save_dtype="fp32",
                      caption_dropout=0.0, prediction=None)
    a = parser.add_argument
    a("--from_weight", default="pretrain", help="base weights: a stage name in --out_dir ('pretrain' = "
      "pretrain_<preset>, 'sft' = sft_<preset>), the path of a weights manifest or of a diffusers folder, or "
      "'base' = --base's transformer")
    a("--lora_name", default="demo", help="names the file: out/lora/lora_<name>_<preset>.safetensors")
    a("--lora_rank", type=int, default=8)
    a("--lora_alpha", type=float, default=None, help="the update is scaled by alpha/rank; default: rank (scale 1)")
    a("--lora_dropout", type=float, default=0.0)
    a("--prior_data", default="auto", help="images trained alongside --data so the model keeps what it already "
      "draws (DreamBooth's prior preservation): a dataset as for --data, 'none', or 'auto' = the built-in shapes "
      "when --data is built-in (the demo), none for your own data")
    a("--prior_samples", type=int, default=120, help="size of a built-in prior dataset")
    a("--lora_targets", default="attention", help=f"comma-separated groups ({', '.join(TARGET_GROUPS)}) or module "
      "name suffixes (e.g. to_q,to_v)")
    args = parser.parse_args()
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.lora_name):
        raise UserError(f"--lora_name {args.lora_name!r}: use letters, digits, '-' and '_' only (it names a file)")
    if args.export_pipeline:
        raise UserError("--export_pipeline is for the full-model stages: a LoRA file loads into any SD3 pipeline "
                        "with load_lora_weights")
    info = init_distributed()
    log = Logger(info)
    torch.manual_seed(args.seed)  # the same adapter initialisation on every rank

    model, components, record = load_start_weights(args)
    try:
        adapted = apply_lora(model, args.lora_targets, args.lora_rank, args.lora_alpha, args.lora_dropout)
        dataset = training_dataset(args, components, model.config.patch_size, log)
        prompts = sample_prompts_for(dataset, args.sample_prompts)
        prior = args.prior_data
        if prior == "auto":
            prior = "builtin" if args.data.startswith("builtin") else "none"
        if prior != "none":
            prior_dataset = training_dataset(args, components, model.config.patch_size, log, data=prior,
                                             num_samples=args.prior_samples)
            log(f"prior preservation: the {len(prior_dataset)} samples of {prior} train alongside {args.data}")
            dataset = torch.utils.data.ConcatDataset([dataset, prior_dataset])
    except (ValueError, DatasetError) as e:
        raise UserError(str(e)) from None
    log(f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha or args.lora_rank:g} on {len(adapted)} layers of "
        f"{record['manifest']} (step {record['step']}, frozen)")
    trained = LoRAAdapters(lora_file(args.out_dir, args.lora_name, args.preset), weights_identity(record, args.out_dir))
    train(args, "lora", model, components, dataset, info, log, prompts, trained=trained,
          name=lora_run_name(args.lora_name, args.preset), sample_first=True)


if __name__ == "__main__":
    run_main(main)
