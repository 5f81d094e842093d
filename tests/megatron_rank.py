"""One trainer rank of a model-parallel cell, for tests/test_megatron_parallel.py: `python -m tests.megatron_rank
SPEC.json`, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment as a cell's launcher sets them.

The spec names the model folder, the sizes, a pickled TrainBatch, an input for logits, and a list of jobs; each
job builds a MegatronTrainer and takes GSPO steps. The leader (rank 0) writes what it saw (logits, each job's
metrics and its Hugging Face mirror after each step) with torch.save to spec["out"]. A job may also save a version
folder and stop there (`save_to`, then `exit_after_save` for every rank, or `kill_rank_after_save: R` for rank R
alone, by SIGKILL: tests/test_megatron_checkpoints.py's first life), or resume from one.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from pathlib import Path

import torch


def full_logits(tr, x: torch.Tensor) -> torch.Tensor:
    """Logits of x [b, s] through every stage (on every rank of the cell)."""
    from gyre_slurm.train.megatron_model import gpt_head, gpt_logits, stage_hidden
    from gyre_slurm.train.megatron_parallel import pipeline_pass

    if tr.par.pp == 1:
        with torch.no_grad():
            return gpt_logits(tr.gpt, x)
    out: list[torch.Tensor] = []

    def stage(model, ids, _mask):
        hidden = stage_hidden(model, ids)
        return gpt_head(model, hidden.transpose(0, 1)) if model.post_process else hidden

    def keep(_k, logits):
        out.append(logits.detach())
        return logits.sum() * 0

    with torch.no_grad():
        pipeline_pass(tr.gpt, [(x, torch.ones_like(x, dtype=torch.bool))], keep, stage_logprobs=stage,
                      forward_only=True)
    return tr.par.from_last_stage(out)[0]


def main() -> None:
    from gyre_slurm.train.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    batch = pickle.loads(Path(spec["batch"]).read_bytes())
    sizes = spec["sizes"]
    result: dict = {"jobs": []}
    for k, job in enumerate(spec["jobs"]):
        tr = MegatronTrainer(Path(job.get("model_dir", spec["model_dir"])), device="cpu", seed=0, **sizes,
                             **job["trainer"])
        for group in tr.optimizer.param_groups:
            group["eps"] = spec["adam_eps"]
        if k == 0:
            result["logits"] = full_logits(tr, torch.load(spec["x"]))
        seen = []
        for _ in range(job.get("steps", 1)):
            m = tr.train_step(batch)
            seen.append({"metrics": m, "state": None if tr.model is None else
                         {n: p.detach().clone() for n, p in tr.model.state_dict().items()}})
        if job.get("save_to"):
            tr.save(Path(job["save_to"]))
            if int(os.environ["RANK"]) == job.get("kill_rank_after_save"):
                os.kill(os.getpid(), signal.SIGKILL)  # kill -9 out of save: no collective of this rank pending
            if job.get("exit_after_save"):
                os._exit(0)  # as a rank killed between steps: no clean shutdown of anything
        result["jobs"].append(seen)
    if int(os.environ["RANK"]) == 0:
        torch.save(result, spec["out"])


if __name__ == "__main__":
    main()
