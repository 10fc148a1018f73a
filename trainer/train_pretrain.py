"""Pretrain SD3-Light from scratch with rectified flow.

    python trainer/train_pretrain.py                                   # tiny model, built-in shapes, on a CPU
    torchrun --nproc_per_node 2 trainer/train_pretrain.py              # the same on 2 processes (DDP)
    python trainer/train_pretrain.py --data my_images/ --resolution 64 --preset small
    python trainer/train_pretrain.py --base /models/sd3-medium --preset base --data my_images/ --resolution 256

Writes out/pretrain_<preset>.json and the files it names (weights for sampling and fine-tuning; a v-prediction
model also as a diffusers transformer in out/pretrain_<preset>/transformer/), sample grids in out/samples/,
metrics in out/pretrain_<preset>_metrics.jsonl, and the resume checkpoint checkpoints/pretrain_<preset>_resume.json
(+ its file). Stop with SIGTERM or Ctrl-C; continue with --from_resume 1.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.image_folder import DatasetError  # noqa: E402
from model.components import check_fits  # noqa: E402
from model.model_sd3light import SD3Light, preset_config  # noqa: E402
from trainer.trainer_utils import (  # noqa: E402
    Logger, UserError, add_training_args, init_distributed, make_components, run_main, sample_prompts_for, train,
    training_dataset,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # pretraining uses the shared defaults (trainer_utils.add_training_args); the prediction defaults to x on the
    # built-in pixel-space components and to v (SD3's own, what diffusers samples) on SD3 components
    add_training_args(parser, prediction=None)
    args = parser.parse_args()
    info = init_distributed()
    log = Logger(info)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    args.prediction = args.prediction or ("v" if args.base else "x")

    try:
        config = preset_config(args.preset)
        components = make_components(args, info)
        check_fits(components, config)
        dataset = training_dataset(args, components, config.patch_size, log)
        prompts = sample_prompts_for(dataset, args.sample_prompts)
    except (ValueError, DatasetError) as e:
        raise UserError(str(e)) from None
    train(args, "pretrain", SD3Light(config), components, dataset, info, log, prompts)


if __name__ == "__main__":
    run_main(main)
