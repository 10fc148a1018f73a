"""What trainer/trainer_utils.py calls: the mechanics below the stage scripts. A stage imports trainer_utils, not
these; none of them imports trainer_utils or a stage."""
