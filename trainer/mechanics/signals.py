"""Stop signals: SIGTERM and SIGINT end a run at a step boundary with a save (StopSignal), and the data loader's
workers leave stopping to the main process."""
import contextlib
import multiprocessing
import os
import signal
import threading
import time

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# torchrun's agent passes the signal it got on to each rank: where every process of a job was signalled (Slurm
# signals a job's processes, `kill` may be given every group), a rank gets the stop twice, so under torchrun a
# second SIGINT this soon after the first is that copy
FORWARDED_SECONDS = 2.0


class StopSignal:
    """SIGTERM and SIGINT (what schedulers send before pre-emption, and Ctrl-C) only set `received`: the loop
    saves at the next step boundary where it reads (each log step: --log_interval; one process alone at the end of
    the step in progress) and returns, so every rank exits 0. A second Ctrl-C stops at once (under
    torchrun, one FORWARDED_SECONDS or more after the first)."""

    def __init__(self):
        self.received, self.previous, self.at = None, {}, 0.0
        self.forwarded = FORWARDED_SECONDS if "TORCHELASTIC_RUN_ID" in os.environ else 0.0

    def handle(self, signum, frame):
        if self.received is None:
            self.received, self.at = signum, time.monotonic()
        elif signum == signal.SIGINT == self.received and time.monotonic() - self.at >= self.forwarded:
            raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stop_signals_held():
    """Hold SIGTERM and SIGINT while data loader workers start: they begin with both blocked (a signal to the whole
    process group would otherwise find a worker before its worker_init_fn has run), and this process gets them, as
    a StopSignal, once the workers have started."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks (and no fork)
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def leave_stopping_to_the_main_process(worker_id):
    """A data loader worker's start: a stop signalled to the whole process group (Ctrl-C, `timeout`,
    `kill -- -PGID`, a scheduler) reaches the workers too, and a worker that died of it made the main process fail
    wherever it was, in the middle of a save too. A worker ignores SIGINT, and SIGTERM but the trainer's (the
    loader ending a worker that did not stop), which it answers as torch's own handler does, by leaving quietly.
    (Processes a dataset starts in a worker inherit SIGTERM blocked.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks; its workers are spawned, not forked
        return
    if not hasattr(signal, "sigwaitinfo"):  # macOS: no sender to tell apart; torch's handler, a group's SIGTERM
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # ends the worker as before
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # blocked since the fork, kept so
    trainer = multiprocessing.parent_process()  # (under forkserver the OS parent is not the trainer)
    threading.Thread(target=exit_on_sigterm_from, args=(trainer.pid if trainer else os.getppid(),),
                     daemon=True).start()


def exit_on_sigterm_from(trainer):
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != trainer:
        pass
    os._exit(0)  # what torch's worker handler does on its parent's SIGTERM: no clean-up, no message
