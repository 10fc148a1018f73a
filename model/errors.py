"""Errors the user can fix, and how every script reports them: one line on stderr, exit code 2, no traceback.

The errors of the data (DatasetError), the cache (CacheError), the components (ComponentsError) and checkpoints
(CheckpointError) are UserErrors, so `run_main` reports them all the same way.
"""
import gc
import sys


class UserError(Exception):
    """A problem the user can fix (a bad path, a mismatched resume, a bad argument): one line, no traceback."""


def run_main(main):
    """Run a script's main(): a UserError becomes one line on stderr and exit code 2; a second Ctrl-C (which
    interrupts a save-and-stop) exits 130; either on a line of its own, below the progress bar it ended. The
    process group, if any, is torn down either way."""
    import torch.distributed as dist

    try:
        main()
    except UserError as e:
        end_progress_bars()
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now; the last committed checkpoint is intact
        end_progress_bars()
        print("interrupted: the last saved checkpoint is intact; continue with --from_resume 1", file=sys.stderr)
        sys.exit(130)
    finally:
        if dist.is_initialized():
            # DDP holds reference cycles: collected only at interpreter exit, after the process group is gone, it
            # made gloo abort the process now and then ("terminate called without an active exception", exit -6)
            # after a run that had finished. Collected here, while the group still exists, it goes quietly.
            gc.collect()
            dist.destroy_process_group()


def end_progress_bars():
    """Close the progress bars an error left drawn (tqdm's, the run's), each ending its line, so that what is
    printed next starts a line of its own and no bar is drawn again below it at exit."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
