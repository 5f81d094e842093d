"""One trainer rank of a model-parallel cell, for tests/test_dist_optimizer.py and the other cell tests: `python -m
tests.megatron_rank SPEC.json`, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment as a cell's
launcher sets them.

The spec names the model folder, the sizes, a pickled TrainBatch, an input for logits, and a list of jobs; each
job builds a MegatronTrainer and takes GSPO steps. The leader (rank 0) writes what it saw (logits, each job's
metrics and the cell's weights as full Hugging Face tensors after each step, every rank's optimizer-state bytes) with
torch.save to spec["out"]. A job may also save a version folder (`save_to`, after `save_at` steps: all of them unless
given) and stop there (`exit_after_save` for every rank, or `kill_rank_after_save: R` for rank R alone, by SIGKILL:
tests/test_megatron_checkpoints.py's first life), or resume from one (`model_dir`, resume_optimizer).
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


def hf_state(tr) -> dict[str, torch.Tensor] | None:
    """The cell's weights as AdamW steps them (the fp32 masters in bf16) as full Hugging Face tensors, on the leader
    (None elsewhere): each row from the replica that keeps it. Collective."""
    from gyre_slurm.train.dist_optimizer import written
    from gyre_slurm.train.optimizer_state import assemble_blocks, unit_blocks

    local = {lt.name: lt for lt in tr._local if lt.primary}
    mine = [b for u in written(tr._shards, tr._units) if u.name in local
            for b in unit_blocks(local[u.name], tr.par.coords, tr._gpt[u.name].shape, u.lo, u.param.detach().cpu())]
    got = tr.par.gather_to_leader(mine)
    return None if got is None else assemble_blocks(b for rank in got for b in rank)


def load_hf_state(tr, state: dict[str, torch.Tensor]) -> None:
    """Full Hugging Face tensors into the trainer's weights, every rank its own cut (a pull for SatelliteStep.load)."""
    from gyre_slurm.train.megatron_shard import state_reader

    tr._load_slices(state_reader(state, tr.par.coords))


def held(tr) -> dict:
    """What this rank's optimizer keeps: elements of its dense and expert tensors in all and kept (stepped here), the
    bytes of AdamW's moments, of the tensors it steps that are not the model's own (fp32 masters, row copies), of
    the storage behind the masters `_main` names (one element where the master is kept elsewhere), and its groups'
    coordinates."""
    from gyre_slurm.train.dist_optimizer import is_expert, state_bytes

    moments, _ = state_bytes(tr.optimizer)
    out = {"moments": moments, "copies": sum(4 * u.param.numel() for u in tr._units if u.param is not tr._gpt[u.name]),
           "main_storage": sum(p.untyped_storage().nbytes() for p in tr._main.values()),
           "tensors": len(tr._gpt), "coords": [tr.par.coords.tp_rank, tr.par.coords.pp_rank, tr.par.coords.ep_rank]}
    for kind, expert in (("dense", False), ("expert", True)):
        out[kind] = sum(p.numel() for n, p in tr._gpt.items() if is_expert(n) == expert)
        out[f"{kind}_held"] = sum(u.param.numel() for u in tr._units if is_expert(u.name) == expert)
    return out


def main() -> None:
    from gyre_slurm.train.megatron_trainer import MegatronTrainer
    from tests import slice_checks

    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    snapshots = Path(spec["out"]).parent / "snapshots"
    batch = pickle.loads(Path(spec["batch"]).read_bytes())
    sizes = spec["sizes"]
    result: dict = {"jobs": [], "held": []}
    for k, job in enumerate(spec["jobs"]):
        tr = MegatronTrainer(Path(job.get("model_dir", spec["model_dir"])), device="cpu", seed=0, **sizes,
                             **job["trainer"])
        for group in tr.optimizer.param_groups:
            group["eps"] = spec["adam_eps"]
        if k == 0:
            result["logits"] = full_logits(tr, torch.load(spec["x"]))
        seen = []
        for step in range(job.get("steps", 1)):
            m = tr.train_step(batch)
            # the weights as a version folder written slice by slice holds them (= hf_state's gather, bit for bit)
            seen.append({"metrics": m, "state": slice_checks.snapshot_state(tr, snapshots / f"job{k}-step{step}")})
            if tr.precision == "bf16":  # what AdamW steps: the fp32 masters (versions carry their bf16 rounding)
                seen[-1]["masters"] = hf_state(tr)
            if job.get("save_to") and step + 1 == job.get("save_at", job.get("steps", 1)):
                tr.save(Path(job["save_to"]))
                if int(os.environ["RANK"]) == job.get("kill_rank_after_save"):
                    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 out of save: no collective of this rank pending
                if job.get("exit_after_save"):
                    os._exit(0)  # as a rank killed between steps: no clean shutdown of anything
        result["jobs"].append(seen)
        result["held"].append(tr.par.gather_to_leader(held(tr)))
        if job.get("slice_checks"):  # tests/slice_checks.py on this trainer, with another one of its layout
            def another(job=job):
                return MegatronTrainer(Path(job.get("model_dir", spec["model_dir"])), device="cpu", seed=0,
                                       **sizes, **job["trainer"])

            result["slices"] = slice_checks.run(tr, another, batch, snapshots / f"job{k}-checks")
    if int(os.environ["RANK"]) == 0:
        torch.save(result, spec["out"])


if __name__ == "__main__":
    main()
