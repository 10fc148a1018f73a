"""The mechanics below the stage scripts, each module one job: processes and data parallelism (distributed.py),
the resume checkpoint (checkpointer.py, sharded_checkpoint.py, state.py), where a run is in its data
(position.py), what it shows (metrics.py), its grids and validation loss (previews.py), the EMA (ema.py), the
optimizers (optimizers.py), stop signals (signals.py) and its folders' lock (run_lock.py). A stage imports each
name from the module that defines it; none of them imports trainer_utils or a stage."""
