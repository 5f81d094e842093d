"""`gyre check`: a run config validated and printed with its defaults, its cells' shape, its task split, the model's
fit to the parallel sizes and the memory plan per GPU (launch/memory_plan.py), which also refuses a config that does
not fit. `gyre layout` prints the same plan (`print_memory_plan`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gyre_slurm.cli_common import console
from gyre_slurm.config import RunConfig, load_config
from gyre_slurm.errors import ConfigError, GyreError
from gyre_slurm.harness.task_split import split_line
from gyre_slurm.launch.memory_fit import MemoryPlan, context_length, fit_problem, plan_memory
from gyre_slurm.launch.model_shape import ModelShape, config_shape


def check(config: Annotated[Path, typer.Argument(help="Run config (YAML).")]) -> None:
    """Validate a run config and print it with every default filled in, then its cells' shape and memory plan."""
    import yaml

    from gyre_slurm.config import dump_config

    cfg = load_config(config)
    console.print(yaml.safe_dump(dump_config(cfg), sort_keys=False), end="")
    console.print(cell_shape(cfg), highlight=False)
    console.print(split_line(cfg.tasks.suite, cfg.eval, cfg.run.seed, cfg.harness.runtime), highlight=False)
    console.print(check_model(cfg, config), highlight=False)
    print_memory_plan(cfg, config)
    console.print(f"[green]{config}: valid[/]")


def cell_shape(cfg: RunConfig) -> str:
    """One line: the cells, the trainer's parallel sizes and ranks, and the rollout engine's."""
    from gyre_slurm.launch.ranks import cell_ranks

    c, t = cfg.cluster, cfg.train
    gpus = f"{c.gpus_per_node} GPUs" if c.gpus_per_cell else "CPU"
    engine = f"SGLang tp {cfg.sglang.tp_size} dp {cfg.sglang.dp_size}" if c.engine == "sglang" else f"engine {c.engine}"
    return (f"cells {c.cells} × {c.nodes_per_cell} node(s) × {gpus}: trainer {t.backend} TP {t.tensor_parallel} · "
            f"PP {t.pipeline_parallel} · DP {t.data_parallel} (EP {t.expert_parallel}) = {cell_ranks(t)} rank(s); "
            f"{engine}")


def check_model(cfg: RunConfig, config: Path) -> str:
    """check_model_fits on model.path's config.json, or why it was skipped."""
    from gyre_slurm.launch.ranks import check_model_fits

    if cfg.model.path is None:
        return f"model checks skipped: the built-in model ({cfg.model.builtin}) is made at start"
    model_json = cfg.model.path / "config.json"
    if not model_json.is_file():
        return f"model checks skipped: no {model_json}"
    try:
        check_model_fits(cfg.train, json.loads(model_json.read_text()))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{config}: {model_json}: {e}") from None
    return f"model {cfg.model.path}: its heads, layers, vocabulary and experts fit the parallel sizes"


def print_memory_plan(cfg: RunConfig, config: Path) -> None:
    """The plan per GPU (per rank on CPU cells) as a table; a GPU config that does not fit is refused in one line."""
    if cfg.cluster.engine == "none":
        console.print("memory plan skipped: no RL loop (cluster.engine: none)", highlight=False)
        return
    try:
        shape, source = config_shape(cfg)
    except GyreError as e:
        console.print(f"memory plan skipped: {e}", highlight=False)
        return
    if shape is None:
        console.print(f"memory plan skipped: {source}", highlight=False)
        return
    for part in plan_lines(plan_memory(shape, cfg), shape, source):
        console.print(part, highlight=False)
    longest = context_length(shape, cfg)
    if longest > cfg.train.micro_batch_tokens:
        console.print(f"note: a sample longer than train.micro_batch_tokens is a micro-batch of its own: the trainer's "
                      f"plan holds for samples up to {cfg.train.micro_batch_tokens:,} tokens (contexts may reach "
                      f"{longest:,})", highlight=False)
    problem = fit_problem(shape, cfg)
    if problem is not None:
        raise ConfigError(f"{config}: {problem}")


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def count(n: float) -> str:
    return f"{n / 1e12:.2f}T" if n >= 1e12 else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _terms(rows: list[tuple[str, str]]) -> Table:
    t = Table(box=None, show_header=False, padding=(0, 1, 0, 2))
    t.add_column("term")
    t.add_column("size", justify="right")
    for row in rows:
        t.add_row(*row)
    return t


def plan_lines(plan: MemoryPlan, shape: ModelShape, source: str) -> list:
    """The plan as printed: a heading, the trainer rank's terms and peak, the engine's weights and KV cache."""
    lay, tr = plan.layout, plan.trainer
    where = f"per GPU of {plan.gpu_bytes / 2**30:g} GiB" if plan.gpu_bytes else "per rank, in host memory (CPU cells)"
    opt = ("one data-parallel replica" if lay.dp == 1 else "distributed optimizer" if lay.distributed_optimizer
           else "every data-parallel replica keeps all optimizer state")
    out: list = [f"memory plan {where}: {source}, {count(shape.count())} parameters "
                 f"({count(shape.count(active=True))} active)",
                 f"trainer rank of stage {tr.stage} ({count(tr.params)} parameters): {lay.precision}, TP {lay.tp} · "
                 f"PP {lay.pp} · DP {lay.dp} · EP {lay.ep}, {opt}, recompute {lay.recompute}, "
                 f"{lay.micro_batch_tokens:,}-token micro-batches"]
    verdict = "" if plan.gpu_bytes is None else " fits" if plan.trainer_fits else " [bold red]does not fit[/]"
    rows = [(label, size(n)) for label, n in tr.terms() if n]  # a term this layout does not have is left out
    rows.append(("[bold]peak[/] (state + largest phase)", f"[bold]{size(tr.total)}[/]{verdict}"))
    out.append(_terms(rows))
    e = plan.engine
    if e is not None and e.kind == "sglang":
        out.append(f"SGLang engine per GPU: tp {e.tp}, mem_fraction_static {e.mem_fraction:g}")
        ctx = "fits" if e.fits else "[bold red]does not fit[/]"
        out.append(_terms([("weights (bf16)", size(e.weights)),
                           (f"KV cache: {e.kv_tokens:,} tokens; one context of {e.context:,} {ctx}",
                            size(max(0, e.kv_pool)))]))
    elif e is not None:
        out.append("embedded engine, in host memory (the node agent runs it on the CPU)")
        out.append(_terms([("weights (fp32)", size(e.weights)),
                           (f"KV cache of one context of {e.context:,} tokens", size(e.kv_pool))]))
    return out


__all__ = ["cell_shape", "check", "check_model", "plan_lines", "print_memory_plan"]
