"""The Megatron trainer backend (`train.backend: megatron`): the shared GSPO step on Megatron-Core's GPTModel, in
one process or over a cell's tensor-, pipeline-, data- and expert-parallel ranks.

The policy trains in Megatron's layout (train/megatron_model.py: local TE-free spec, fused QKV, gate‖up); the rest
of the system speaks Hugging Face. No rank ever holds the whole model (train/megatron_shard.py says who holds what):
each reads its slices straight from a checkpoint's safetensors files (`folder_reader`, `load_weights`); a version's
folder is written slice by slice (train/slice_snapshot.py: each full tensor by one rank from its TP peers' slices);
a version is published over the Transfer Engine by every sending rank from its own process (`publish`,
train/slice_parts.py) and a satellite's ranks load the pieces of their own cut (`load_parts`); gradients go from
each satellite rank to the core rank of the same place, by local Megatron name (`send_grads`, `take_grads`,
train/rank_grads.py).

Model parallelism (train/megatron_parallel.py): TP on the linear layers inside Megatron; PP through Megatron's 1F1B
schedule over the step's micro-batches (the GSPO loss on the last stage; its sums go to the other stages after);
DP by cutting each forward_backward's batch run-aligned into dp parts that share the step's normaliser, gradients
all-reduced (SUM) before they are used. Every rank is called with the same arguments (SPMD). The optimizer is
torch's AdamW (the same update Megatron's DDP + optimizer make; gradients all-reduced in 256 MiB buckets); with
`distributed_optimizer` (the default) the fp32 masters and moments are split by rows over the DP replicas, each
stepping its 1/d and sending the updated weights to the others (train/dist_optimizer.py). Its state is saved per
rank in each version's folder by Hugging Face tensor name and block (`optimizer.rank{r}-of-{world}.pt` and
`optimizer.index.json`, train/optimizer_state.py): a cell of the same shape resumes exactly, one of another shape
cuts it for itself.
Activation recomputation (`recompute`, train.recompute): train/megatron_model.py.

Precision (`precision`, the config's train.precision): fp32, or Megatron's bf16 mixed precision as its
`Float16OptimizerWithFloat16Params` and DDP make it (megatron/core/optimizer/optimizer.py,
distributed/distributed_data_parallel.py): bf16 parameters and activations; an fp32 master copy of each parameter
(`_main`; a storage-less stand-in where the distributed optimizer keeps the master elsewhere) whose `.grad` is the
fp32 main gradient — each backward's bf16 gradient is added into it and dropped, so
micro-batches accumulate in fp32 —; clipping, the gradient all-reduces, export/add_grads and AdamW (fp32 moments)
work on the masters, and the bf16 parameters are copied from them after each step. Log-probs and the GSPO loss are
fp32 (the head's logits are upcast before the log-softmax). Snapshots and published versions hold the model's own
weights (`_slices`: bf16 in bf16, as Megatron exports them); the optimizer files hold the fp32 masters, so a resume
is exact. "auto": bf16 on CUDA, fp32 elsewhere.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from gyre_slurm.model.qwen3 import Qwen3Config
from gyre_slurm.parallel_sizes import check_parallel
from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.train.batch import TrainBatch
from gyre_slurm.train.dist_optimizer import (
    link_grads,
    make_units,
    plan_shards,
    stand_in_master,
    units_to_weights,
    weights_to_units,
    written,
)
from gyre_slurm.train.grad_channel import GradMessage
from gyre_slurm.train.gspo_trainer import OPTIMIZER_GLOB, GSPOTrainer
from gyre_slurm.train.gspo_trainer import log as train_log
from gyre_slurm.train.megatron_convert import check_supported
from gyre_slurm.train.megatron_model import (
    RECOMPUTE,
    build_gpt,
    gpt_state,
    gpt_target_logprobs,
    keep_recompute,
    stage_target_logprobs,
)
from gyre_slurm.train.megatron_parallel import Parallel, Rendezvous, init_parallel, pipeline_pass
from gyre_slurm.train.megatron_shard import folder_reader, local_state, local_tensors
from gyre_slurm.train.metrics import merge_metrics
from gyre_slurm.train.optimizer_state import MASTER, SavedReader, rank_file, read_index, save_state
from gyre_slurm.train.rank_grads import PIECE_WAIT_S, GradLink, Key, RankGrads, all_have, why_not_fits
from gyre_slurm.train.shards import split_indices, subset
from gyre_slurm.train.slice_parts import SliceLink
from gyre_slurm.train.slice_snapshot import save_slices
from gyre_slurm.transfer.report import TransferReport
from gyre_slurm.transfer.weight_parts import RankLink

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MegatronTrainer(GSPOTrainer):
    """GSPOTrainer's arguments, the cell's model-parallel sizes (world = tp·pp·dp ranks) and the training precision
    ("fp32", "bf16" or "auto": bf16 on CUDA; `self.precision` is the one in force)."""

    def __init__(self, model_dir: Path, *args, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 data_parallel: int = 1, expert_parallel: int = 1, rendezvous: Rendezvous | None = None,
                 precision: str = "auto", distributed_optimizer: bool = True, recompute: str = "none",
                 **kwargs) -> None:
        check_parallel(tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
        if precision not in ("auto", *PRECISIONS):
            raise ValueError(f"precision must be auto, fp32 or bf16, not {precision!r}")
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be none or full, not {recompute!r}")
        self.precision, self.recompute = precision, recompute
        self._distributed = distributed_optimizer  # optimizer state sharded over DP replicas (dist_optimizer.py)
        self._sizes = (tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
        self._rendezvous = rendezvous  # where this cell's ranks meet (train/rank_group.py); None: env:// or world 1
        self._pending = False  # gradients accumulated here and not yet all-reduced
        super().__init__(model_dir, *args, **kwargs)

    def _build(self) -> tuple[list[Tensor], int]:
        self.config = Qwen3Config.from_pretrained(self.model_dir)
        check_supported(self.config)
        self.par: Parallel = init_parallel(*self._sizes, self.device, self._rendezvous)
        self.device = self.par.device  # a GPU with its index, bound to this process
        if self.precision == "auto":
            self.precision = "bf16" if self.device.type == "cuda" else "fp32"
        dtype = PRECISIONS[self.precision]
        c = self.par.coords
        self._local = local_tensors(self.config, c)
        self.gpt = build_gpt(self.config, dtype, pre_process=c.first_stage, post_process=c.last_stage,
                             recompute=self.recompute, **self.par.model_overrides(dtype)).to(self.device)
        self.gpt.eval()  # no dropout anywhere (the configs set it to 0 as well)
        keep_recompute(self.gpt)
        self._gpt = gpt_state(self.gpt)
        self._shards = plan_shards({n: p.shape for n, p in self._gpt.items()}, *self.par.dp_groups(), self._distributed)
        self._main = self._gpt if dtype == torch.float32 else _main_params(self._gpt, self._shards.holds)
        self._units = make_units(self._shards, self._gpt, self._main)  # the rows this rank's AdamW steps
        if set(self._gpt) != {lt.name for lt in self._local}:
            raise RuntimeError(f"GPTModel parameters {sorted(set(self._gpt) ^ {lt.name for lt in self._local})[:4]} "
                               "differ from the shard plan")
        self._link = SliceLink()  # this rank's publisher and puller over the Transfer Engine
        self._grads = RankGrads()  # this rank's gradient receiver and sender (satellites ↔ core, rank to rank)
        self._load_slices(folder_reader(self.model_dir, c))
        pad = json.loads((self.model_dir / "config.json").read_text()).get("pad_token_id")
        return list(self._main.values()), int(pad or 0)

    # -- the backend's pieces ---------------------------------------------------------------------------------
    def _logprobs(self, input_ids: Tensor, target_mask: Tensor) -> Tensor:
        return gpt_target_logprobs(self.gpt, input_ids, target_mask)

    def _grad_micros(self, micros, loss_of) -> None:
        if self._experts_across_dp():
            return self._paired_passes(micros, loss_of, grad=True)
        if self.par.pp == 1:
            return super()._grad_micros(micros, loss_of)
        pipeline_pass(self.gpt, micros, loss_of, stage_logprobs=stage_target_logprobs, forward_only=False)

    def _no_grad_logprobs(self, micros: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        if self.par.pp == 1 and not self._experts_across_dp():
            return super()._no_grad_logprobs(micros)
        out: list[Tensor] = [torch.zeros(0)] * len(micros)

        def keep(k: int, logp: Tensor) -> Tensor:
            out[k] = logp.detach()
            return logp.sum() * 0

        with torch.no_grad():
            if self.par.pp == 1:
                self._paired_passes(micros, keep, grad=False)
            else:
                pipeline_pass(self.gpt, micros, keep, stage_logprobs=stage_target_logprobs, forward_only=True)
        return self.par.from_last_stage(out)

    def _experts_across_dp(self) -> bool:
        return bool(self.config.num_experts) and self.par.coords.ep > 1

    def _paired_passes(self, micros: list[tuple[Tensor, Tensor]], loss_of, *, grad: bool) -> None:
        """Expert parallelism over DP ranks that hold different micro-batches: Megatron's allgather dispatcher
        gathers equal token counts from every EP rank in every layer, forward and backward. So the DP ranks make the
        same number of passes, pass k of each padded to the largest [rows, width] among them (right padding, no
        targets: a real target's log-prob is unchanged), and a rank out of micro-batches runs padding only."""
        shapes = self.par.all_gather_dp([tuple(ids.shape) for ids, _ in micros])
        for k in range(max(len(s) for s in shapes)):
            rows = max(s[k][0] for s in shapes if k < len(s))
            width = max(s[k][1] for s in shapes if k < len(s))
            ids = torch.full((rows, width), self.pad_id, dtype=torch.long, device=self.device)
            mask = torch.zeros((rows, width), dtype=torch.bool, device=self.device)
            if k < len(micros):
                b, n = micros[k][0].shape
                ids[:b, :n], mask[:b, :n] = micros[k]
            logp = self._logprobs(ids, mask)
            loss = loss_of(k, logp) if k < len(micros) else logp.sum() * 0
            if grad:
                loss.backward()

    def _share(self, acc: dict) -> dict:
        return self.par.from_last_stage(acc)

    def forward_backward(self, batch: TrainBatch, prox: Sequence[Tensor] | None = None) -> dict[str, float]:
        """As GSPOTrainer's; with DP, this DP rank takes its run-aligned part (the whole step's normaliser kept) and
        the parts' metrics are merged as shards of one loss."""
        if batch.runs():
            self._pending = True
        if self.par.dp == 1:
            return super().forward_backward(batch, prox)
        parts = split_indices(batch, n_shards=self.par.dp)
        mine = parts[self.par.dp_rank] if self.par.dp_rank < len(parts) else []
        part = subset(batch, mine, n_valid_runs=batch.normaliser(), meta=batch.meta)
        m = super().forward_backward(part, None if prox is None else [prox[i] for i in mine])
        if not part.runs() and self._experts_across_dp():  # no pass of its own: it pads its peers' two passes
            self._no_grad_logprobs([])
            self._grad_micros([], None)
        parts_m = [p for p in self.par.all_gather_dp(m) if p["runs"] > 0] or [m]
        out = merge_metrics(parts_m, shared_normaliser=True)
        return {**m, **out}

    def zero_grad(self) -> None:
        super().zero_grad()
        for p in self.params:  # the main gradients of tensors whose optimizer state another replica keeps too
            p.grad = None
        self._pending = False

    def _sync(self) -> None:
        """All-reduce what this rank accumulated since the last sync (collective: every rank calls it together)."""
        if self._pending and self.par.world > 1:
            self.par.sync_grads(self._main, tied_pp=self.config.tie_word_embeddings)
        self._pending = False

    def _clip_grads(self, max_norm: float) -> float:
        self._sync()
        if self.par.world == 1:
            norm = super()._clip_grads(max_norm)
        else:
            norm = self.par.grad_norm(self._main, self._local)
            coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            if coef < 1:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        link_grads(self._units, self._main)  # the rows AdamW steps, of the clipped main gradients
        return norm

    def _after_update(self) -> None:
        self._masters_to_weights()

    def _masters_to_weights(self) -> None:
        """The bf16 weights from the fp32 masters this rank keeps, then every replica from the owners' updates
        (collective over the DP groups when the optimizer is distributed)."""
        with torch.no_grad():
            units_to_weights(self._units, self._gpt)
            self._shards.share(self._gpt)

    def grad_shapes(self) -> dict[str, tuple[int, ...]]:
        """The gradient this rank takes from another cell's rank of the same place: local names and shapes."""
        return {n: tuple(p.shape) for n, p in self._main.items()}

    def export_grads(self) -> dict[str, Tensor]:
        """This rank's accumulated gradient by local Megatron name, after the cell's all-reduces ({} when nothing
        was accumulated)."""
        self._sync()
        if all(p.grad is None for p in self._main.values()):
            return {}
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for n, p in self._main.items()}

    def add_grads(self, grads: dict[str, Tensor]) -> None:
        """Add this rank's piece of another cell's gradient (local names and shapes, as `export_grads` of a rank of
        the same place gives them; a tensor missing from it adds zero)."""
        self._sync()
        why = why_not_fits(grads, self.grad_shapes())
        if why is not None:
            raise KeyError(why)
        for n, g in grads.items():
            p = self._main[n]
            g = g.to(p.device, p.dtype)
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)

    # -- gradients rank to rank (train/rank_grads.py) -------------------------------------------------------------
    def open_grads(self, token: str, step: int, link: GradLink) -> list[str] | None:
        """Every rank: its gradient receiver for `step`; the endpoints by rank on the leader (None elsewhere)."""
        nbytes = sum(p.numel() * p.element_size() for p in self._main.values())
        return self.par.gather_to_leader(self._grads.open(token, step, link, self.par.rank, nbytes))

    @property
    def grad_inbox(self) -> RankGrads | None:
        """The leader's receiver (what its step runner polls) while one is open."""
        return self._grads if self._grads.receiver is not None else None

    def take_grads(self, key: Key, wait_s: float = PIECE_WAIT_S) -> bool:
        """Every rank: add its piece of satellite message `key` if every rank has its piece and it fits; else none
        adds (False)."""
        self._sync()
        msg = self._grads.take(tuple(key[:3]) + (tuple(key[3]),), wait_s)
        why = "its piece did not come" if msg is None else why_not_fits(msg.grads, self.grad_shapes())
        if why is not None:
            log.warning("rank %d: gradients of %s for shards %s: %s", self.par.rank, key[0], list(key[3]), why)
        if not all_have(self.par, why is None):
            return False
        self.add_grads(msg.grads)
        return True

    def send_grads(self, header: GradMessage, endpoints: list[str], token: str,
                   link: GradLink | None) -> str | None:
        """Every rank: its exported gradient under `header` to the core rank of the same place; on the leader, why a
        rank could not send it (None: every rank did). Not raised here: a follower that raised would be gone."""
        msg = GradMessage(header.step, header.version_in, header.shard_ids, header.sender, self.export_grads(),
                          header.metrics)
        why = self._grads.try_send(msg, endpoints[self.par.rank], token, link, self.par.rank)
        got = self.par.gather_to_leader(why)
        return None if got is None else next((w for w in got if w), None)

    def close_grads(self, linger_s: float = 0.0) -> None:
        self._grads.close(linger_s)

    # -- versions slice by slice (train/slice_parts.py) -----------------------------------------------------------
    def publish(self, version: int, link: RankLink, source: str = "") -> list[WeightsHandle] | None:
        """Every rank: its primary slices into its own publisher (once per version); the version's parts on the
        leader (None elsewhere)."""
        part = self._link.publish(self.par, self._senders(), self._slices(), version, link, source)
        got = self.par.gather_to_leader(part)
        return None if got is None else [h for h in got if h is not None]

    def load_parts(self, parts: list[WeightsHandle], link: RankLink,
                   receiver: str) -> tuple[list[TransferReport], str | None] | None:
        """Every rank: its own cut of the version in `parts` (a cell of this layout published it), pulled, and loaded
        into its slices once every rank has it (else no rank loads anything); on the leader every rank's reports and
        why a rank could not pull (None: all did). Not raised here: a follower that raised would be gone."""
        name = receiver if self.par.world == 1 else f"{receiver}/rank{self.par.rank}"
        pieces, reports, why = self._link.try_pull(self.par, self._local, parts, link, name)
        if all_have(self.par, why is None):
            self._load_slices(lambda n, _dim: pieces[n])
        got = self.par.gather_to_leader((reports, why))
        if got is None:
            return None
        return [r for rs, _ in got for r in rs], next((w for _, w in got if w), None)

    def close(self) -> None:
        """Release this rank's Transfer Engine memory (version slots, pull staging) and gradient sockets."""
        self._link.close()
        self._grads.close()

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights in place (parameter objects and optimizer state stay); every rank reads its slices."""
        self._load_slices(folder_reader(Path(model_dir), self.par.coords))

    def _save_weights(self, out_dir: Path, extra: Callable[[Path], None]) -> Path:
        """The version folder in the Hugging Face layout, written slice by slice (train/slice_snapshot.py: each
        full tensor by one rank from its TP peers' slices, no rank holding the whole model); every rank writes its
        optimizer state into it before it is renamed into place."""
        return save_slices(self.par, self._senders(), self._slices(), self.model_dir, out_dir, extra)

    # -- the optimizer (train/dist_optimizer.py: who keeps what; train/optimizer_state.py: on disk) ---------------
    def _make_optimizer(self, lr: float, weight_decay: float, embedding_lr: float | None) -> torch.optim.Optimizer:
        """AdamW over the rows this rank keeps (`_units`): all of them, or its share with the distributed optimizer."""
        groups = self._param_groups(lr, embedding_lr)  # one group: the Megatron trainer has no embedding_lr
        groups[0]["params"] = [u.param for u in self._units]
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)

    def _optimizer_name(self) -> str:
        return rank_file(self.par.rank, self.par.world)

    def _write_optimizer(self, folder: Path) -> None:
        """Every rank: the moments (and bf16 masters) of the rows it writes, by Hugging Face name and block; the
        leader the index. Collective."""
        t, p, d, e = self._sizes
        shape = dict(tensor_parallel=t, pipeline_parallel=p, data_parallel=d, expert_parallel=e, world=self.par.world)
        save_state(folder, self.par, self._local, written(self._shards, self._units),
                   {n: w.shape for n, w in self._gpt.items()}, self.optimizer, masters=self._main is not self._gpt,
                   steps=self.steps, shape=shape, precision=self.precision, distributed=self._shards.distributed)

    def _resume_optimizer(self) -> None:
        """The state of the tensors this rank keeps, cut for this cell's shape from whatever shape saved it."""
        index = read_index(self.model_dir)
        if index is None:
            older = ", ".join(sorted(f.name for f in self.model_dir.glob(OPTIMIZER_GLOB)))  # an older format's
            train_log.log(logging.WARNING if older else logging.INFO, "no optimizer state by Hugging Face name in "
                          "%s%s: AdamW starts from zero", self.model_dir, f" (only {older})" if older else "")
            return
        reader, local = SavedReader(self.model_dir, index), {lt.name: lt for lt in self._local}
        with torch.no_grad():
            for u in self._units:
                got = reader.unit(local[u.name], self.par.coords, self._gpt[u.name].shape, u.lo, u.hi)
                if got is None:
                    continue
                st, step = got
                if MASTER in st:  # the fp32 masters (bf16 training): the weights on disk may be their rounding
                    u.param.copy_(st.pop(MASTER))
                self.optimizer.state[u.param] = {"step": torch.tensor(step, dtype=torch.float32),
                                                 **{k: v.to(u.param.device) for k, v in st.items()}}
        if MASTER in index.states:
            self._masters_to_weights()  # every replica's weights from the masters (collective)
        self.steps = index.steps
        train_log.info("optimizer state resumed from %s (%d steps, saved at %s): %s", self.model_dir, self.steps,
                       index.shape, ", ".join(sorted(reader.files)) or "no tensor of this rank's")

    # -- the slices ------------------------------------------------------------------------------------------------
    def _load_slices(self, read) -> None:
        with torch.no_grad():
            for n, t in local_state(self.config, self.par.coords, read).items():
                self._gpt[n].copy_(t)
                weights_to_units(self._units, self._gpt, n, t)  # the masters (bf16), the rows kept apart

    def _slices(self) -> dict[str, Tensor]:
        """This rank's weights by local name, as versions carry them: the model's own (in bf16 training the bf16
        weights, as Megatron exports them; the fp32 masters are spread over the DP replicas by the distributed
        optimizer and saved with its state, train/optimizer_state.py)."""
        return {n: p.detach() for n, p in self._gpt.items()}

    def _senders(self):
        """The local tensors this rank sends in a gather (each tensor of the model from exactly one rank: among its
        DP replicas the one that keeps its fp32 master, train/dist_optimizer.py; DP rank 0 without)."""
        return [lt for lt in self._local if self._shards.writes(lt.name)]


def _main_params(params: dict[str, Tensor], holds: Callable[[str], bool]) -> dict[str, Tensor]:
    """An fp32 master of each (bf16) parameter this rank `holds` (values set by the caller), a stand-in without storage
    for the others (another replica keeps theirs). Each backward's gradient of a parameter is added to its master's
    .grad in fp32 and dropped, as megatron-core's DDP backward hook does into main_grad."""
    main = {n: torch.nn.Parameter(p.detach().float()) if holds(n) else stand_in_master(p) for n, p in params.items()}
    for n, p in params.items():
        p.register_post_accumulate_grad_hook(partial(_into_main, main[n]))
    return main


def _into_main(main: Tensor, p: Tensor) -> None:
    g = p.grad.float()
    main.grad = g if main.grad is None else main.grad.add_(g)
    p.grad = None
