"""gyre_slurm: elastic online RL for extremely long-horizon agents, Slurm-native, with a central daemon."""

__version__ = "0.1.0"
