"""Pretrain SD3-Light from scratch with rectified flow.

    python trainer/train_pretrain.py                                   # tiny model, built-in shapes, on a CPU
    torchrun --nproc_per_node 2 trainer/train_pretrain.py              # the same on 2 processes (DDP)
    python trainer/train_pretrain.py --data my_images/ --resolution 64 --preset small

Writes out/pretrain_<preset>.json and the files it names (weights for sampling and fine-tuning), sample grids in
out/samples/, metrics in out/pretrain_<preset>_metrics.jsonl, and the resume checkpoint
checkpoints/pretrain_<preset>_resume.json (+ its file). Stop with SIGTERM or Ctrl-C; continue with --from_resume 1.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.image_folder import DatasetError, build_dataset  # noqa: E402
from dataset.shapes import GRAMMAR_WORDS  # noqa: E402
from model.components import BuiltinComponents, check_fits  # noqa: E402
from model.model_sd3light import SD3Light, preset_config  # noqa: E402
from trainer.trainer_utils import (  # noqa: E402
    Logger, UserError, add_training_args, init_distributed, run_main, sample_prompts_for, train,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_args(parser)  # pretraining uses the shared defaults; see trainer_utils.add_training_args
    args = parser.parse_args()
    info = init_distributed()
    log = Logger(info)
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    try:
        dataset = build_dataset(args.data, args.resolution, num_samples=args.num_samples, seed=args.seed, log=log)
        config = preset_config(args.preset)
        components = BuiltinComponents(GRAMMAR_WORDS)
        check_fits(components, config)
        prompts = sample_prompts_for(dataset, args.sample_prompts)
    except (ValueError, DatasetError) as e:
        raise UserError(str(e)) from None
    train(args, "pretrain", SD3Light(config), components, dataset, info, log, prompts)


if __name__ == "__main__":
    run_main(main)
