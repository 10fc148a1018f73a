"""Full fine-tune (SFT): continue training every weight of a trained model on your data.

    python trainer/train_full_sft.py                                   # from out/pretrain_tiny, built-in data
    torchrun --nproc_per_node 2 trainer/train_full_sft.py --data my_images/ --resolution 64
    python trainer/train_full_sft.py --from_weight path/to/weights.json --preset small
    python trainer/train_full_sft.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/

Starts from `--from_weight` (a stage name in --out_dir, or a weights path; its preset must be --preset, and
its prediction and components are kept). Writes out/sft_<preset>.json and the files it names, sample grids in
out/samples/ (step 0 shows the starting weights), metrics in out/sft_<preset>_metrics.jsonl and the resume
checkpoint checkpoints/sft_<preset>_resume.json. Stop with SIGTERM or Ctrl-C; continue with --from_resume 1.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.image_folder import DatasetError  # noqa: E402
from trainer.trainer_utils import (  # noqa: E402
    Logger, UserError, add_training_args, init_distributed, load_start_weights, run_main, sample_prompts_for, train,
    training_dataset,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Fine-tuning defaults: a tenth of the pretraining learning rate, a short warmup, one pass over 8,000 samples
    # (500 steps, about two CPU minutes for the tiny model). The prediction comes from the weights.
    add_training_args(parser, learning_rate=1e-4, warmup_steps=20, epochs=1, num_samples=8000, prediction=None)
    parser.add_argument("--from_weight", default="pretrain",
                        help="weights to start from: a stage name in --out_dir ('pretrain' = pretrain_<preset>), "
                        "the path of a weights manifest or of a diffusers folder, or 'base' = --base's transformer")
    args = parser.parse_args()
    info = init_distributed()
    log = Logger(info)
    torch.manual_seed(args.seed)

    model, components, record = load_start_weights(args)
    log(f"starting from {record['manifest']} (step {record['step']}, predicts {record['prediction']})")
    try:
        dataset = training_dataset(args, components, model.config.patch_size, log)
        prompts = sample_prompts_for(dataset, args.sample_prompts)
    except (ValueError, DatasetError) as e:
        raise UserError(str(e)) from None
    train(args, "sft", model, components, dataset, info, log, prompts, sample_first=True)


if __name__ == "__main__":
    run_main(main)
