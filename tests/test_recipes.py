"""The stages' real-model recipes: published weights (--preset sd3-medium, sd3.5-medium, sd3.5-large) train with a
real fine-tune's values (each cited in the stage's parse_args), the demo keeps its own, a flag given wins, and the
acceptance commands' memory estimate at 1024 px fits a 24 GB card."""
import pytest

import trainer.train_distill as train_distill
import trainer.train_dpo as train_dpo
import trainer.train_full_sft as train_full_sft
import trainer.train_lora as train_lora
import trainer.train_pretrain as train_pretrain
from model.memory import GIB
from model.model_sd3light import PUBLISHED_PRESETS
from tests.card_estimate import card_estimate, card_plan

MEDIUM = ["--base", "/models/sd3.5-medium", "--from_weight", "base", "--preset", "sd3.5-medium", "--data", "my_images"]
RECIPES = {
    train_lora: dict(learning_rate=1e-4, lora_rank=16, lora_alpha=None, lora_targets="attention", batch_size=1,
                     accumulation_steps=4, warmup_steps=0, min_lr_ratio=1.0, max_steps=500, weight_decay=1e-4,
                     gradient_checkpointing="auto", resolution=1024, sigma_scheme="logit_normal", train_shift=3.0,
                     ema_decay=0.0, caption_dropout=0.0, frozen_dtype="auto"),
    train_full_sft: dict(trained_dtype="bf16", stochastic_rounding=1, optimizer="adamw8bit", ema_decay=0.0,
                         learning_rate=1e-5, batch_size=1, accumulation_steps=4, warmup_steps=0, min_lr_ratio=1.0,
                         max_steps=500, weight_decay=1e-4, resolution=1024, gradient_checkpointing="auto",
                         train_shift=3.0, export_single_file=True),
    train_dpo: dict(dpo_beta=100.0, lora_rank=32, lora_alpha=64.0, learning_rate=3e-4, weight_decay=1e-4,
                    resolution=512, batch_size=4, accumulation_steps=6, gradient_checkpointing="auto"),
    train_distill: dict(learning_rate=1e-6, warmup_steps=50, weight_decay=0.0, real_guidance=4.0, gen_update_ratio=10,
                        gan_weight=0.0, ema_decay=0.0, batch_size=1, resolution=1024, gradient_checkpointing="auto"),
}


@pytest.mark.parametrize("stage", list(RECIPES), ids=lambda stage: stage.__name__.split(".")[-1])
def test_published_weights_train_with_the_real_model_recipe(stage):
    for preset in PUBLISHED_PRESETS:
        pairs = ["--pairs", "pairs.jsonl"] if stage is train_dpo else []
        argv = ["--base", "/models/sd3", "--preset", preset] + pairs
        args = stage.parse_args(argv)
        assert {name: getattr(args, name) for name in RECIPES[stage]} == RECIPES[stage]
        assert args.recipe_note.startswith(f"the real-model recipe (--preset {preset}")
    for demo_argv in (["--base", "/models/sd3-tiny", "--preset", "sd3-tiny"],  # the tests' tiny SD3 folder
                      ["--preset", "sd3.5-medium"]):  # no SD3 components: not published weights (x-prediction here)
        demo = stage.parse_args(demo_argv)
        assert demo.recipe_note.startswith("the demo's recipe") and demo.resolution == 32
        assert any(getattr(demo, name) != value for name, value in RECIPES[stage].items())


def test_a_flag_given_wins_over_the_real_model_recipe_and_the_pretrain_stage_has_none():
    args = train_lora.parse_args(MEDIUM + ["--learning_rate", "3e-4", "--resolution", "768", "--batch_size", "2"])
    assert (args.learning_rate, args.resolution, args.batch_size, args.lora_rank) == (3e-4, 768, 2, 16)
    assert "recipe_note" not in vars(args)  # not an argument: a resume compares vars(args)
    assert "resolution 768 (your flag)" in args.recipe_note and "lora_rank 16," in args.recipe_note
    sft = train_full_sft.parse_args(MEDIUM + ["--no-export_single_file"])  # a switch the recipe turns on, turned off
    assert sft.export_single_file is False and train_full_sft.parse_args(MEDIUM).export_single_file is True
    assert train_pretrain.parse_args(MEDIUM[:2] + ["--preset", "sd3.5-medium"]).learning_rate == 1e-3  # the demo's


@pytest.mark.parametrize("stage", [train_lora, train_full_sft], ids=["lora", "sft"])
def test_the_acceptance_commands_estimate_at_most_20_gib_at_1024_px(stage):
    args = stage.parse_args(MEDIUM)
    assert args.resolution == 1024
    assert card_estimate(stage, args) <= 20 * GIB


def test_auto_checkpointing_recomputes_only_the_blocks_a_card_needs():
    """--gradient_checkpointing auto (the real-model recipes): an SD3.5-Medium LoRA at batch 1 recomputes no block
    on a 24 GB card (a second forward of every block doubled the step at batch 1 on an H200) and a few on 16 GB, at
    batch 4 on 24 GB some; the full fine-tune in bf16 some of its 24 on 24 GB and every one on 16; and what it
    chose fits the card."""
    lora, sft = train_lora.parse_args(MEDIUM), train_full_sft.parse_args(MEDIUM)
    lora4 = train_lora.parse_args(MEDIUM + ["--batch_size", "4", "--accumulation_steps", "1"])
    for stage, args, card, blocks in ((train_lora, lora, 24, 0), (train_lora, lora, 16, range(1, 5)),
                                      (train_lora, lora4, 24, range(1, 24)), (train_full_sft, sft, 24, range(1, 24)),
                                      (train_full_sft, sft, 16, [True])):
        plan = card_plan(stage, args, card * GIB)
        assert plan.checkpointing in (blocks if isinstance(blocks, (range, list)) else [blocks]), (stage, card)
        if plan.checkpointing is not True:  # what auto chose fits (the full fine-tune on 16 GB takes more levers)
            assert card_estimate(stage, args, card * GIB) <= 0.9 * card * GIB
    everything = card_estimate(train_lora, train_lora.parse_args(MEDIUM + ["--gradient_checkpointing", "1"]))
    assert card_estimate(train_lora, lora, 24 * GIB) > everything  # auto spends the memory for speed


def test_help_lists_the_real_model_recipe(capsys):
    with pytest.raises(SystemExit):
        train_lora.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    recipe = "the real-model recipe replaces the demo's defaults: learning_rate 0.0001, lora_rank 16, batch_size 1"
    assert recipe in shown
