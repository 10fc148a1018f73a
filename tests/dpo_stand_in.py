"""trainer/train_dpo.py with a stand-in verifier that prefers the brighter image, for tests: the tiny models they
train for a step or two draw no shapes yet, so the shape scorer would find every image alike and give no pairs.

    python tests/dpo_stand_in.py <train_dpo.py's arguments>      (or under torchrun; main(argv) for
                                                                 tests/stage_runs.py)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trainer.train_dpo as train_dpo  # noqa: E402
from model.errors import run_main  # noqa: E402
from trainer import preference  # noqa: E402


def brightness_scores(spec, images):
    """uint8 images [k, H, W, 3] -> (their mean brightness in [0, 1], none right)."""
    return np.array([image.mean() / 255 for image in images]), np.zeros(len(images), dtype=bool)


def main(argv=None):
    preference.score_images = brightness_scores
    return train_dpo.main(argv)


if __name__ == "__main__":
    run_main(main)
