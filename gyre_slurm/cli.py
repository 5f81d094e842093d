"""The `gyre` command. Errors a user can act on are printed as one line and exit with status 1."""

from __future__ import annotations

import csv
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.table import Table

from gyre_slurm.cli_cells import cells_app
from gyre_slurm.cli_check import check
from gyre_slurm.cli_common import (
    ConfigOpt,
    RunArg,
    RunDirOpt,
    RunIdOpt,
    StateDir,
    console,
    err_console,
    run_dir_of,
)
from gyre_slurm.cli_eval import evaluate
from gyre_slurm.cli_export import export
from gyre_slurm.cli_harness import harness_app
from gyre_slurm.cli_images import images_app
from gyre_slurm.cli_simulate import simulate
from gyre_slurm.cli_slurm import keep, layout, layout_of, node_run, submit, this_host
from gyre_slurm.config import load_config
from gyre_slurm.config_reference import field_reference
from gyre_slurm.errors import GyreError
from gyre_slurm.harness.task_split import split_line

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="gyre: elastic online RL for long-horizon agents on Slurm.")
app.add_typer(cells_app, name="cells")
app.add_typer(harness_app, name="harness")
app.add_typer(images_app, name="images")
app.command("simulate")(simulate)


def _logging(run_dir: Path | None, name: str) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s",
                        handlers=handlers, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise


_run_dir = run_dir_of


# --- running ------------------------------------------------------------------------------------------------
@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Run config (YAML).")],
    run_id: Annotated[str | None, typer.Option(help="Run id; default: the config's name and a timestamp.")] = None,
) -> None:
    """Run everything on this machine: the daemon and one node agent per node (the embedded default)."""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.launch.local import start_local_run
    from gyre_slurm.protocol import ShutdownRequest
    from gyre_slurm.rundir import run_id_for

    cfg = load_config(config)
    run_id = run_id_for(cfg, run_id)
    # a bad suite stops here
    console.print(split_line(cfg.tasks.suite, cfg.eval, cfg.run.seed, cfg.harness.runtime), highlight=False)
    if cfg.cluster.engine != "none":
        from gyre_slurm.bootstrap.base_model import ensure_model
        from gyre_slurm.launch.start_check import check_model_at_start

        t_model = time.monotonic()
        path = ensure_model(cfg, echo=console.print)
        check_model_at_start(cfg, path)  # a planning shape, sizes that do not split, a plan that does not fit
        console.print(f"policy version 0: {path} (ready in {time.monotonic() - t_model:.1f} s)")
    console.print(f"[bold]gyre run[/] {run_id}: {cfg.cluster.cells} cells × {cfg.cluster.nodes_per_cell} node(s), "
                  f"policy {cfg.scheduler.policy}; state in {cfg.run.state_dir / run_id}")
    t0 = time.monotonic()
    local = start_local_run(cfg, run_id)
    console.print(f"daemon and {len(local.agents)} node agents up in {time.monotonic() - t0:.1f} s")
    try:
        if console.is_terminal:
            with Live(console=console, refresh_per_second=2, transient=True) as live:
                while local.supervise():  # a process that dies is started again (launch/supervise.py)
                    live.update(_status_renderable(local.run_dir))
                    time.sleep(0.5)
        else:  # a log file or a pipe: one progress line every few seconds instead of a redrawn table
            last = 0.0
            while local.supervise():
                if time.monotonic() - last >= 5:
                    console.print(_progress_line(local.run_dir, time.monotonic() - t0), highlight=False)
                    last = time.monotonic()
                time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the run")
        try:
            request(local.run_dir, ShutdownRequest(), timeout_s=5)
        except GyreError:
            pass
    if local.gave_up:
        console.print(f"[bold red]giving up:[/] {local.gave_up}; stopping the run")
        try:
            request(local.run_dir, ShutdownRequest(), timeout_s=5)
        except GyreError:
            pass
    local.wait(timeout_s=30)
    console.print(_status_renderable(local.run_dir))
    if local.gave_up:
        raise GyreError(f"{local.gave_up}; see {local.run_dir}/logs/")
    if local.failed():
        raise GyreError(f"some processes exited with errors {local.failed()}; see {local.run_dir}/logs/")
    if cfg.cluster.engine != "none":
        console.print(_summary(local.run_dir))
    console.print(f"[bold]run {run_id} stopped cleanly[/] after {time.monotonic() - t0:.1f} s")


@app.command()
def daemon(
    config: Annotated[Path | None, typer.Argument(help="Run config (YAML), saved as the run's config (or "
                                                       "--run-dir).")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Instead of CONFIG: the run folder whose saved "
                                                                   "config to run (a launcher saved it).")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id; an existing run is resumed from its ledger.")] = None,
    cell_jobs: Annotated[bool, typer.Option("--cell-jobs", help="Every cell is a Slurm job of its own (gyre "
                                                                "submit's daemon job): SIGTERM suspends.")] = False,
    eval_version: Annotated[int | None, typer.Option(help="Resume the stopped run only to evaluate this version "
                                                          "(-1: its last), then stop (gyre eval).")] = None,
) -> None:
    """Start (or resume) a run's coordinator daemon in the foreground (its model must be ready: `gyre model create`)."""
    from gyre_slurm.bootstrap.base_model import base_model_path
    from gyre_slurm.coordinator.daemon import run_daemon
    from gyre_slurm.run_context import RunContext

    if (config is None) == (run_dir is None):
        raise GyreError("gyre daemon needs a run config or --run-dir (one of the two)")
    ctx = RunContext.create(load_config(config), run_id) if config is not None else RunContext.open(run_dir)
    cfg = ctx.config
    base = base_model_path(cfg) if cfg.cluster.engine != "none" else None
    _logging(None, "daemon")
    run_daemon(cfg, ctx.run_dir, ctx.run_id, base_model=base, cell_jobs=cell_jobs, eval_only=eval_version)


@app.command()
def agent(
    run_dir: RunDirOpt = None,
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    node_index: Annotated[int | None, typer.Option(help="This node's index; default: from SLURM_NODEID.")] = None,
    cell: Annotated[int | None, typer.Option(help="With one Slurm job per cell: this job's cell.")] = None,
    connect_wait_s: Annotated[float, typer.Option(help="How long to wait for the daemon to appear (s).")] = 300.0,
) -> None:
    """Start a node agent (normally one per node, started by srun or submitit)."""
    from gyre_slurm.agent.backend import backend_for
    from gyre_slurm.agent.node_agent import NodeAgent, node_index_from_env
    from gyre_slurm.run_context import RunContext

    ctx = RunContext.of_process(run_dir, config, run_id, wait_s=connect_wait_s)
    if node_index is None:
        if cell is None and "SLURM_JOB_NODELIST" in os.environ:  # one allocation: the layout says who is who
            node_index = layout_of(ctx.config).node_index(this_host())
        else:
            node_index = node_index_from_env(cell, ctx.config.cluster.nodes_per_cell)
    _logging(ctx.run_dir, f"agent[{node_index}]")
    NodeAgent(ctx.run_dir, node_index, backend_for(ctx.config, ctx.run_dir, node_index),
              connect_wait_s=connect_wait_s).serve()


app.command()(submit)  # the Slurm-facing commands live in cli_slurm.py
app.command("eval")(evaluate)
app.command("export")(export)  # replays the ledger into TensorBoard / W&B (cli_export.py)
app.command()(layout)
app.command("check")(check)
app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(keep)
app.command("node-run")(node_run)


@app.command()
def proxy(
    run_dir: RunDirOpt = None,
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    host: Annotated[str | None, typer.Option(help="Listen address (default: proxy.host of the run, else "
                                                  "127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: proxy.port of the run, else 0 = any free "
                                                  "one).")] = None,
    model_path: Annotated[Path | None, typer.Option(help="A ready checkpoint folder (default: the run's base "
                                                         "model); with it the run needs no config.yaml.")] = None,
    ready_file: Annotated[Path | None, typer.Option(help='Written {"url": ...} once serving (default: '
                                                         'RUN/proxy/ready.json).')] = None,
    proxy_id: Annotated[str | None, typer.Option(help="Stable name of this proxy (its journal); default: the "
                                                      "host name.")] = None,
    parser: Annotated[str | None, typer.Option(help="Tool-call parser (default: from the model's "
                                                    "config.json).")] = None,
    served_model: Annotated[list[str] | None, typer.Option(
        help="A model name (or fnmatch pattern) to answer; repeat for more; the plain names are what /v1/models "
             "lists; other names get 404 (default: policy and any other name).")] = None,
    check_canonical: Annotated[bool, typer.Option(
        "--check-canonical", help="Compare every reused prompt with the canonical render (a health metric; costs "
                                  "CPU).")] = False,
    idle_check_s: Annotated[float, typer.Option(help="Ask the daemon whether rollouts idle this long are still "
                                                     "open (their state is freed).")] = 300.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Start the TITO proxy (OpenAI-compatible API for the harnesses; records every model call)."""
    from gyre_slurm.bootstrap.base_model import base_model_path
    from gyre_slurm.proxy.app import run_proxy
    from gyre_slurm.run_context import RunContext

    # a given checkpoint makes the run config optional (tests, a proxy started by hand)
    ctx = RunContext.of_process(run_dir, config, run_id, wait_s=300, config_optional=model_path is not None)
    rd, cfg = ctx.run_dir, ctx.cfg
    _logging(rd, "proxy")
    logging.getLogger().setLevel(log_level.upper())
    if cfg is not None and cfg.cluster.engine == "none":
        logging.getLogger("gyre.proxy").info("this run has no RL loop (cluster.engine: none): no proxy needed")
        return
    run_proxy(rd, model_path or base_model_path(cfg), host or (cfg.proxy.host if cfg else "127.0.0.1"),
              port if port is not None else (cfg.proxy.port if cfg else 0), ready_file or rd / "proxy" / "ready.json",
              proxy_id=proxy_id, parser=parser, served_models=served_model or None, check_canonical=check_canonical,
              idle_check_s=idle_check_s)


@app.command()
def worker(
    run_dir: RunDirOpt = None,
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    worker_id: Annotated[str | None, typer.Option(help="Name of this worker (default: host-pid).")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Agent runs at once (default: harness.concurrency).")] = None,
    eval_retries: Annotated[int | None, typer.Option(help="Re-evaluations of an evaluator error "
                                                          "(default: harness.eval_retries).")] = None,
) -> None:
    """Start a harness worker: takes rollouts from the daemon, runs the agent harness, scores the workspace."""
    import os
    import socket

    from gyre_slurm.config_harness import HarnessSection
    from gyre_slurm.harness.image_runtime import image_runtime_of
    from gyre_slurm.harness.sandbox import Limits, make_sandbox
    from gyre_slurm.run_context import RunContext
    from gyre_slurm.worker.service import run_worker

    # a run folder without config.yaml (a daemon of another launcher) gets the harness defaults
    ctx = RunContext.of_process(run_dir, config, run_id, wait_s=300, config_optional=True)
    rd, cfg = ctx.run_dir, ctx.cfg
    _logging(rd, "worker")
    if cfg is not None and cfg.cluster.engine == "none":
        logging.getLogger("gyre.worker").info("this run has no RL loop (cluster.engine: none): no worker needed")
        return
    harness = cfg.harness if cfg is not None else HarnessSection()
    state_dir = cfg.run.state_dir if cfg is not None else rd.parent
    images, images_why = image_runtime_of(harness, state_dir)
    run_worker(rd, worker_id or f"{socket.gethostname()}-{os.getpid()}", concurrency or harness.concurrency,
               eval_retries=harness.eval_retries if eval_retries is None else eval_retries,
               sandbox=make_sandbox(harness.sandbox, harness.network),
               limits=Limits(harness.max_memory_mb, harness.max_processes, harness.max_open_files),
               images=images, images_why=images_why)


@app.command()
def engine(
    model_path: Annotated[Path, typer.Option(help="Hugging Face Qwen3 folder (config.json + *.safetensors).")],
    host: Annotated[str, typer.Option(help="Listen address (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one (see --ready-file).")] = 0,
    weight_version: Annotated[str, typer.Option(help="Reported in every response's meta_info.")] = "0",
    seed: Annotated[int, typer.Option(help="Sampling seed (a request's sampling_seed overrides it).")] = 0,
    ready_file: Annotated[Path | None, typer.Option(
        help='Written atomically once listening: {"url", "pid", "model_path", "weight_version"}.')] = None,
    threads: Annotated[int, typer.Option(help="Torch threads (machines are shared).")] = 1,
    device: Annotated[str, typer.Option(help="Torch device of the model and its KV (cpu, cuda, cuda:1).")] = "cpu",
    max_running_requests: Annotated[int, typer.Option(help="Requests decoded together; more wait.")] = 32,
    chunked_prefill_size: Annotated[int, typer.Option(help="Prompt tokens per prefill step.")] = 512,
    prefix_cache_tokens: Annotated[int, typer.Option(
        help="Tokens of reusable KV the LRU keeps (in bytes: this many tokens of the model's KV; the default holds "
             "about a dozen ~19k-token agent conversations).")] = 1 << 18,
    context_length: Annotated[int | None, typer.Option(
        help="Longest prompt + output (default: the config's max_position_embeddings).")] = None,
    temp_scaled_logprobs: Annotated[bool, typer.Option(
        "--temp-scaled-logprobs", help="Return log_softmax(logits / temperature), SGLang's default, "
        "instead of temperature-1 logprobs.")] = False,
    kv_export_mb: Annotated[int, typer.Option(
        help="Cap (MiB) on the KV caches of aborted calls kept for migration to another engine (export_kv aborts, "
             "POST /import_kv elsewhere) and not yet freed; beyond it an abort exports nothing and the call "
             "re-prefills where it continues. 0: never export.")] = 1024,
    kv_export_ttl_s: Annotated[float, typer.Option(
        help="How long an exported KV waits for its importer before it is freed (it outlives a memory release).")
    ] = 120.0,
    weight_sessions: Annotated[bool, typer.Option(help="SGLang's weight-update sessions (/begin_weight_update ... "
        "/end_weight_update); --no-weight-sessions: as a build from before them (the routes 404).")] = True,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "warning",
    parent_pid: Annotated[int | None, typer.Option(
        help="Stop when this process, the one that started the engine, is gone (node agents pass theirs).")] = None,
) -> None:
    """Serve the embedded rollout engine (torch Qwen3 behind SGLang's HTTP routes) until SIGTERM."""
    from gyre_slurm.engines.model_thread import EngineOptions
    from gyre_slurm.engines.serve import run_engine
    from gyre_slurm.spawn import exit_with_parent as watch_parent

    if parent_pid is not None:
        watch_parent(parent_pid)

    opts = EngineOptions(model_path=str(model_path), weight_version=weight_version, seed=seed,
                         max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
                         prefix_cache_tokens=prefix_cache_tokens, context_length=context_length,
                         temp_scaled_logprobs=temp_scaled_logprobs, kv_export_mb=kv_export_mb,
                         kv_export_ttl_s=kv_export_ttl_s, device=device, weight_sessions=weight_sessions,
                         transfer_host=host if host != "0.0.0.0" else socket.getfqdn())
    run_engine(opts, host=host, port=port, ready_file=ready_file, threads=threads, log_level=log_level)


@app.command("trainer-rank", hidden=True)
def trainer_rank(spec: Annotated[Path, typer.Argument(help="The rank group's spec (JSON).")],
                 rank: Annotated[int, typer.Option(help="This process's rank in its cell (1…n-1).")],
                 parent_pid: Annotated[int | None, typer.Option(
                     help="The node agent that leads the cell, when on this node.")] = None) -> None:
    """A follower rank of a multi-rank cell's trainer (started by the cell's node agent; train/rank_group.py)."""
    from gyre_slurm.spawn import exit_with_parent
    from gyre_slurm.train.rank_group import follow

    if parent_pid is not None:
        exit_with_parent(parent_pid)
    follow(spec, rank)


model_app = typer.Typer(no_args_is_help=True, help="The policy model.")
app.add_typer(model_app, name="model")


@model_app.command("create")
def model_create(config: Annotated[Path, typer.Argument(help="Run config (YAML) whose model to build.")]) -> None:
    """Build the built-in model of a config, tiny or long (created and warmed up once, then reused by every run)."""
    from gyre_slurm.bootstrap.base_model import ensure_model

    cfg = load_config(config)
    if cfg.cluster.engine == "none":
        console.print("this run has no RL loop (cluster.engine: none): no model needed")
        return
    t0 = time.monotonic()
    path = ensure_model(cfg, echo=console.print)
    console.print(f"model ready in {path} ({time.monotonic() - t0:.1f} s)")


# --- looking ------------------------------------------------------------------------------------------------
def _status_renderable(run_dir: Path):
    from gyre_slurm.ledger import queries
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.rundir import ledger_path, read_control
    from gyre_slurm.status_view import render_status

    conn = connect_readonly(ledger_path(run_dir))
    try:
        s = queries.status_summary(conn)
    finally:
        conn.close()
    try:
        ctl = read_control(run_dir)
        alive = queries.daemon_alive(ctl)
        where = f"{ctl.endpoint} pid {ctl.daemon_pid}"
        daemon_txt = {True: f"up ({where})", False: f"not running (was {where})", None: f"on {ctl.daemon_host}"}[alive]
    except GyreError:
        daemon_txt = "never started"
    return render_status(s, daemon_txt)


def _progress_line(run_dir: Path, elapsed: float) -> str:
    from gyre_slurm.ledger import queries
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.rundir import ledger_path

    conn = connect_readonly(ledger_path(run_dir))
    try:
        s = queries.status_summary(conn, n_switches=0, n_events=0)
        p = queries.progress(conn)
    finally:
        conn.close()
    roles = " ".join(f"{c['cell']}:{c['role']}" for c in s["cells"])
    reward = "-" if p["last_reward"] is None else f"{p['last_reward']:.3f}"
    degraded = (s["run"] or {}).get("degraded_reason")
    training = f" | {queries.open_step_text(s['open_step'])}" if s["open_step"] else ""
    return (f"[{elapsed:6.1f}s] " + (f"DEGRADED: {degraded} | " if degraded else "")
            + f"steps {p['steps_done']}/{p['max_steps']} | runs of open groups {p['done']}/{p['admitted']} "
            f"done | last step reward {reward} | cells {roles}{training} | model calls {s['model_calls']:,}")


def _summary(run_dir: Path) -> str:
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.rundir import ledger_path
    from gyre_slurm.status_view import run_summary

    conn = connect_readonly(ledger_path(run_dir))
    try:
        return run_summary(conn)
    finally:
        conn.close()


@app.command()
def status(
    run: RunArg = "last",
    state_dir: StateDir = Path("state"),
    watch: Annotated[float, typer.Option(help="Refresh every N seconds (0 = print once).")] = 0.0,
) -> None:
    """Cells, roles, heartbeats, last switches and progress of a run, read from its ledger."""
    run_dir = _run_dir(run, state_dir)
    if watch <= 0:
        console.print(_status_renderable(run_dir))
        return
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            live.update(_status_renderable(run_dir))
            time.sleep(watch)


@app.command()
def stop(run: RunArg = "last", state_dir: StateDir = Path("state")) -> None:
    """Stop a run cleanly: every agent stops and the ledger closes the run (a `gyre submit` run's jobs all end)."""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.protocol import ShutdownRequest

    run_dir = run_dir_of(run, state_dir)
    request(run_dir, ShutdownRequest())
    console.print(f"run {run_dir.name}: stopping")


@app.command("runs")
def runs_cmd(state_dir: StateDir = Path("state")) -> None:
    """List the runs under the state folder, newest last."""
    from gyre_slurm.ledger.readonly import connect_readonly, query_dicts
    from gyre_slurm.rundir import ledger_path, list_runs

    t = Table()
    for c in ("run", "status", "policy", "started", "cells"):
        t.add_column(c)
    for d in list_runs(state_dir):
        conn = connect_readonly(ledger_path(d))
        try:
            r = query_dicts(conn, "SELECT status, policy, created_at, (SELECT count(*) FROM cells) AS cells "
                                  "FROM runs LIMIT 1")
        finally:
            conn.close()
        if r:
            t.add_row(d.name, r[0]["status"], r[0]["policy"],
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r[0]["created_at"])), str(r[0]["cells"]))
    console.print(t)


@app.command()
def sql(
    run: Annotated[str, typer.Argument(help="Run id.")],
    query: Annotated[str, typer.Argument(help="One read-only SQL statement (SELECT / WITH / EXPLAIN).")],
    state_dir: StateDir = Path("state"),
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
) -> None:
    """Read-only SQL on a run's ledger; a write statement is refused and the ledger is unchanged."""
    from gyre_slurm.ledger.readonly import connect_readonly, run_query
    from gyre_slurm.rundir import ledger_path

    if fmt not in ("table", "csv", "json"):
        raise GyreError(f"--format must be table, csv or json, not {fmt!r}")
    conn = connect_readonly(ledger_path(_run_dir(run, state_dir)))
    try:
        cols, rows = run_query(conn, query)
    finally:
        conn.close()
    if fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    elif fmt == "json":
        print(json.dumps([dict(zip(cols, r, strict=True)) for r in rows], indent=1))
    else:
        t = Table()
        for c in cols:
            t.add_column(c)
        for r in rows:
            t.add_row(*("NULL" if v is None else str(v) for v in r))
        console.print(t)
        console.print(f"[dim]{len(rows)} row(s)[/]")


@app.command()
def plot(
    run: RunArg = "last",
    state_dir: StateDir = Path("state"),
    out: Annotated[Path | None, typer.Option(help="PNG to write (default: state/<run>/plot.png).")] = None,
) -> None:
    """Draw a run: reward per step, tokens trained per step, and every cell's role over time (PNG)."""
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.plot import plot_run
    from gyre_slurm.rundir import ledger_path

    run_dir = _run_dir(run, state_dir)
    conn = connect_readonly(ledger_path(run_dir))
    try:
        path = plot_run(conn, out or run_dir / "plot.png", f"gyre run {run_dir.name}")
    finally:
        conn.close()
    console.print(f"wrote {path}")


@app.command("tree")
def tree_cmd(
    run: Annotated[str, typer.Argument(help="Run id (or a unique prefix, or 'last', or a run folder).")],
    rollout: Annotated[int, typer.Argument(help="Rollout id (rollouts.id).")],
    state_dir: StateDir = Path("state"),
    max_depth: Annotated[int, typer.Option(help="Levels drawn before a '…' line.")] = 16,
    max_children: Annotated[int, typer.Option(help="Branches drawn per node before a '…' line.")] = 8,
) -> None:
    """Draw a rollout's trajectory tree: one line per node (kind, tokens, trainable, how its call ended)."""
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.rundir import ledger_path
    from gyre_slurm.trajectory.draw import render
    from gyre_slurm.trajectory.persist import SEGMENT_FILE, read_tree

    run_dir = _run_dir(run, state_dir)
    conn = connect_readonly(ledger_path(run_dir))
    try:
        ro, rows, source = read_tree(conn, run_dir, rollout)
    finally:
        conn.close()
    reward = "" if ro["reward"] is None else f" · reward {ro['reward']:g}"
    if source == "ledger":
        where = " · from the ledger (tree_nodes)"
    elif rows:
        why = "the rollout is still running" if ro["status"] in ("QUEUED", "RUNNING") else "none were written"
        where = f" · rebuilt from {SEGMENT_FILE} (no tree_nodes rows: {why})"
    else:
        where = ""
    calls = f"{ro['n_calls']} model call{'s' * (ro['n_calls'] != 1)}"
    title = f"rollout {ro['id']} of {run_dir.name} · {ro['status']}{reward} · {calls}{where}"
    for line in render(rows, title, max_depth=max_depth, max_children=max_children):
        typer.echo(line)


@app.command("config-doc")
def config_doc() -> None:
    """Print the reference of every config field (Markdown), as in docs/config.md."""
    print("| field | type | default | meaning |")
    print("|---|---|---|---|")
    for name, tname, default, doc in field_reference():
        print(f"| `{name}` | {tname} | `{default}` | {doc} |")


def main() -> None:
    try:
        app()
    except GyreError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
