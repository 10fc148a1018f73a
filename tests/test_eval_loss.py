"""Held-out loss at fixed sigmas: the noise is fixed per sample and sigma, so numbers compare across runs."""
import torch

from dataset.shapes import GRAMMAR_WORDS, ShapesDataset
from eval.eval_loss import SIGMAS, quantile_losses
from model.components import BuiltinComponents
from model.model_sd3light import SD3Light, preset_config
from tests.conftest import randomise


def test_quantile_losses_do_not_depend_on_the_batch_and_do_tell_weights_apart():
    model = SD3Light(preset_config("tiny")).eval()
    randomise(model, seed=0)  # a fresh model outputs zeros (adaLN-Zero): every weights file would look alike
    components = BuiltinComponents(GRAMMAR_WORDS)
    data = ShapesDataset("heldout", 6, 32)
    cpu = torch.device("cpu")

    in_fours = quantile_losses(model, components, data, 6, 4, cpu, "x")
    at_once = quantile_losses(model, components, data, 6, 6, cpu, "x")
    assert list(in_fours) == SIGMAS
    for sigma in SIGMAS:
        assert abs(in_fours[sigma] - at_once[sigma]) <= 1e-6 * at_once[sigma]
    assert quantile_losses(model, components, data, 6, 4, cpu, "x") == in_fours  # the same noise every time

    randomise(model, seed=1)
    other = quantile_losses(model, components, data, 6, 4, cpu, "x")
    assert all(other[sigma] != in_fours[sigma] for sigma in SIGMAS)
