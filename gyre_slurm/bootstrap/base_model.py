"""Where a run's starting weights (version 0) come from: `model.path`, or the built-in tiny model, created and
warmed up once per (seed, warm-up steps, digits) under state/models/ and reused by every later run.

Only launchers build it (`gyre run`, `gyre model create`, the sbatch script, `gyre submit`): the daemon, the
proxy and the agents are handed a ready checkpoint folder (`base_model_path`) and never create or train one.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.harness.install import harness_name, package


def _warmup_digits(cfg: RunConfig) -> tuple[int, ...]:
    """The built-in model is warmed up on the conversation format of the run's suite (all digits for a JSONL)."""
    from gyre_slurm.harness.builtin_suite import SUITES

    name = cfg.tasks.suite.removeprefix("builtin:")
    return SUITES.get(name, SUITES["digits"]) if cfg.tasks.suite.startswith("builtin:") else SUITES["digits"]


def _warmup_phrasings(cfg: RunConfig) -> tuple[str, ...]:
    from gyre_slurm.harness.builtin_suite import REWORDED

    return REWORDED.get(cfg.tasks.suite.removeprefix("builtin:"), ("",))


def builtin_dir(cfg: RunConfig) -> Path:
    digits = "".join(map(str, _warmup_digits(cfg))) + ("r" if len(_warmup_phrasings(cfg)) > 1 else "")
    m = cfg.model
    if m.builtin == "long":  # warmed up on its harness's own conversations: one model per harness and release
        h = cfg.harness.which
        cli = package(h).version if h != "reference" else "any"
        return (cfg.run.state_dir / "models" /
                f"long-qwen3-s{m.seed}-w{m.warmup_steps}x{m.warmup_demos}-{harness_name(h)}-{cli}-d{digits}")
    return cfg.run.state_dir / "models" / f"tiny-qwen3-s{m.seed}-w{m.warmup_steps}-d{digits}"


def _is_built(folder: Path) -> bool:
    return (folder / "gyre_model.json").is_file() and (folder / "model.safetensors").is_file()


def base_model_path(cfg: RunConfig) -> Path:
    """The ready checkpoint folder of version 0; never builds one (raises GyreError saying how to)."""
    if cfg.model.path is not None:
        if not (cfg.model.path / "config.json").is_file():
            raise GyreError(f"model.path: {cfg.model.path} has no config.json (not a Hugging Face checkpoint)")
        return cfg.model.path
    out = builtin_dir(cfg)
    if not _is_built(out):
        raise GyreError(f"the built-in tiny model is not built yet ({out}); run `gyre model create CONFIG` first "
                        "(gyre run, gyre submit and sbatch/gyre.sbatch do it)")
    return out


def ensure_model(cfg: RunConfig, echo: Callable[[str], None] = lambda _m: None) -> Path:
    """The folder of version 0; builds the built-in model if needed (safe when several processes race)."""
    if cfg.model.path is not None:
        return cfg.model.path
    out = builtin_dir(cfg)
    if _is_built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one lock per model: a long model's build (minutes) never holds up the build or use of another model
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "model.safetensors").is_file():
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        base = tmp.with_name(tmp.name + "-init")
        shutil.rmtree(base, ignore_errors=True)
        if cfg.model.builtin == "long":
            _build_long(cfg, base, tmp, echo)
        else:
            _build_tiny(cfg, base, tmp, echo)
        shutil.rmtree(base, ignore_errors=True)
        (tmp / "gyre_model.json").write_text(json.dumps({"kind": f"{cfg.model.builtin}-qwen3", "seed": cfg.model.seed,
                                                          "warmup_steps": cfg.model.warmup_steps,
                                                          "harness": harness_name(cfg.harness.which)}) + "\n")
        tmp.rename(out)
    return out


def _build_tiny(cfg: RunConfig, base: Path, out: Path, echo: Callable[[str], None]) -> None:
    from gyre_slurm.bootstrap.warmup import warm_up
    from gyre_slurm.model.tiny import create_tiny_model  # torch: only when a model is built

    echo(f"creating the built-in tiny model (seed {cfg.model.seed}) in {out.with_suffix('')}")
    create_tiny_model(base, seed=cfg.model.seed)
    if cfg.model.warmup_steps:
        echo(f"warming it up: {cfg.model.warmup_steps} supervised steps on the harness's conversation format")
        warm_up(base, out, steps=cfg.model.warmup_steps, seed=cfg.model.seed, digits=_warmup_digits(cfg),
                phrasings=_warmup_phrasings(cfg))
    else:
        shutil.copytree(base, out)


# The long model's demonstrations: answers right more often than the tiny model's (its harnesses' formats take most
# of what a short warm-up can teach; RL still has the count and the odd wrong digit to learn), and the share of the
# warm-up spent on the tails alone (bootstrap/warmup_demos.py: the curriculum).
LONG_P_RIGHT = 0.7
LONG_SHORT_FRACTION = 0.6
HELD_OUT = 2  # demonstrations at workspace paths of their own, never trained on: the warm-up's check samples there


def _build_long(cfg: RunConfig, base: Path, out: Path, echo: Callable[[str], None]) -> None:
    """The long-context model, warmed up on demonstrations its harness's real CLI produced (bootstrap/demos.py)."""
    from gyre_slurm.bootstrap.demos import record_demos
    from gyre_slurm.bootstrap.warmup_demos import warm_up_on_demos
    from gyre_slurm.model.heap import freed_memory_kept
    from gyre_slurm.model.long import create_long_model

    m, harness = cfg.model, cfg.harness.which
    preset = harness_name(harness)
    echo(f"creating the built-in long-context model (seed {m.seed}, Qwen3 tokenizer) in {out.with_suffix('')}")
    create_long_model(base, seed=m.seed)
    if not m.warmup_steps:
        shutil.copytree(base, out)
        return
    echo(f"recording {m.warmup_demos} demonstrations of the {preset} harness on built-in tasks")
    demos, held_out = record_demos(harness, base, cfg.run.state_dir, m.warmup_demos, seed=m.seed,
                                   digits=_warmup_digits(cfg), p_right=LONG_P_RIGHT, held_out=HELD_OUT,
                                   max_tokens=cfg.harness.max_tokens, echo=echo)
    short = round(LONG_SHORT_FRACTION * m.warmup_steps)
    echo(f"warming it up: {m.warmup_steps} supervised steps on them ({short} on their tails alone, then the rest "
         "with the CLI's whole prompt)")
    with freed_memory_kept():  # a third less CPU per step (model/heap.py)
        warm_up_on_demos(base, out, demos, m.warmup_steps - short, m.seed, held_out=held_out, short_steps=short,
                         lr=6e-3, batch_size=8, echo=echo)
