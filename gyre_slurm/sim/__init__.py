"""A discrete-event simulator of elastic scheduling (docs/algorithms.md §5.2) that drives the real policy objects of
gyre_slurm.scheduler, for `gyre simulate`: the paper's four workloads (paper.py), fitted on the baselines
(calibrate.py), and replays of a real run's ledger (replay.py).

One module, one job: workload.py (the workload model), state.py (entities), engine.py (the event loop and the
decision executor), metrics.py, compare.py (the three policies, async tuned), calibrate.py, paper.py, replay.py,
sweep.py, report.py (tables), timeline.py (the PNG). Importing it loads neither torch nor sqlalchemy.
"""
