"""The config of a run's harnesses (`harness`): which agent CLI, its sandbox and limits, and how runs of tasks that name
a container image are run (`harness.images`: harness/image_runtime.py, harness/cgroups.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gyre_slurm.config_eval import Section
from gyre_slurm.errors import GyreError
from gyre_slurm.harness.cli_spec import CliSpec, resolve


class ImagesSection(Section):
    """Runs of tasks that name a container image (harness/image_runtime.py)."""

    cache_dir: Path | None = Field(None, description="Where each node unpacks images, once each (content-addressed, "
                                   "shared read-only by its runs); null = <run.state_dir>/images. Point it at a "
                                   "node-local disk on a cluster (e.g. /tmp/gyre-images).")
    cpus: float | None = Field(1.0, gt=0, description="CPU cores of one image run (harness and what it starts; a "
                               "cgroup CPU quota: throttled, never ended); null = none.")
    memory_mb: int | None = Field(4096, ge=64, description="Memory of one image run (cgroup; else RLIMIT_AS per "
                                  "process). The OOM killer acting ends the run, scored from its workspace; null = "
                                  "none.")
    processes: int | None = Field(1024, ge=8, description="Processes and threads of one image run at once (cgroup "
                                  "pids; else RLIMIT_NPROC). fork() refused ends the run, scored; null = none.")
    disk_mb: int | None = Field(4096, ge=1, description="Disk of one image run's writable layer (its changes: "
                                "watched each 0.5 s, and no file larger). Past it the run ends, scored; null = none.")




class HarnessSection(Section):
    preset: Literal["reference", "claude-code", "codex", "cli"] = Field(
        "reference", description="The agent harness: reference (harness.command), claude-code (Claude Code, `claude "
        "-p`), codex (Codex CLI, `codex exec`) or cli (any CLI described by harness.cli), unmodified; `gyre harness "
        "install NAME` installs a CLI. Each run gets its own HOME in its workspace; the proxy's address and the run's "
        "key go into the CLI's own variables."
    )
    cli: CliSpec | None = Field(
        None, description="cli: a shipped CLI spec's name (qwen-code, opencode, mini-swe-agent) or a whole spec: npm "
        "or pip, version, binary, api, argv, env, files, shell_tool (docs/proxy-and-harnesses.md: \"Add a CLI by "
        "config\")."
    )
    command: list[str] | None = Field(
        None, description="reference: the harness argv ({python} = this interpreter, {workspace}, {prompt} = the task "
        "as one argument); it gets OPENAI_BASE_URL / OPENAI_API_KEY and ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY. "
        "null = the built-in reference agent."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Arguments added to the preset's command line (before the task's prompt)."
    )
    model_name: str = Field("gyre-policy", description="The model name harnesses are told to ask for (the proxy "
                                                      "serves any name).")
    max_turns: int = Field(8, ge=1, description="claude-code: the CLI's --max-turns (agentic turns per run); cli: "
                           "{max_turns} in its spec.")
    timeout_s: float = Field(120.0, gt=0, description="Wall-clock limit of one agent run (s); then it is scored.")
    eval_retries: int = Field(1, ge=0, description="Re-evaluations of a run whose evaluator failed (never re-rolled).")
    workers: int = Field(1, ge=0, description="Harness worker processes gyre run starts (0: none, run `gyre worker` "
                                              "elsewhere).")
    concurrency: int = Field(16, ge=1, description="Agent runs one worker runs at once.")
    max_tokens: int = Field(256, ge=1, description="claude-code: the CLI's output-token limit per call "
                            "(CLAUDE_CODE_MAX_OUTPUT_TOKENS; it asks for 32,000 otherwise); cli: {max_tokens} in its "
                            "spec. Other harnesses set "
                            "their own max_tokens (the reference agent: 128).")
    sandbox: Literal["auto", "bwrap", "none"] = Field(
        "auto", description="Each harness in bubblewrap: its own workspace writable, the machine read-only, the "
                            "state folder (control.json, ledger, other workspaces) and the evaluator's folders "
                            "hidden. auto: bwrap where it works, else unsandboxed and said so at start; bwrap: "
                            "required (a worker without it refuses to start); none: unsandboxed.")
    network: Literal["proxy-only", "host"] = Field(
        "proxy-only", description="A sandboxed harness's network. proxy-only: a network namespace of its own whose "
                                  "one way out is its proxy, through a relay (no daemon port, no other host); "
                                  "host: the machine's network (the daemon's port is reachable, but refuses "
                                  "frames without the run token).")
    max_memory_mb: int | None = Field(None, ge=64, description="Address-space limit of a harness and what it starts "
                                                                "(MB, RLIMIT_AS); null = none (V8 reserves much).")
    max_processes: int | None = Field(4096, ge=1, description="Process limit of the harness's user (RLIMIT_NPROC; "
                                                               "root is exempt); null = none.")
    max_open_files: int | None = Field(4096, ge=16, description="Open-file limit of a harness (RLIMIT_NOFILE); "
                                                                 "null = none.")
    runtime: Literal["auto", "host", "image", "podman"] = Field(
        "auto", description="Where a run lives. auto: in its task's container image when the task names one "
        "(bubblewrap over the image's root file system), else on this machine's (harness.sandbox); host: always on "
        "this machine's (a task naming an image is refused); image: every task in its image, with bubblewrap (one "
        "naming none is refused); podman: likewise, in podman containers (root only).")
    images: ImagesSection = Field(default_factory=ImagesSection, description="Image runs: cache and limits.")

    @field_validator("command")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not all(isinstance(a, str) and a for a in v)):
            raise ValueError("must be a non-empty list of arguments")
        return v

    @field_validator("cli", mode="before")
    @classmethod
    def _shipped_spec(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return resolve(v)
        except GyreError as e:
            raise ValueError(str(e)) from None

    @property
    def which(self) -> str | CliSpec:
        """The run's harness: a preset's name, or the spec of preset cli."""
        return self.cli or self.preset

    @model_validator(mode="after")
    def _cli_is_for_cli(self) -> HarnessSection:
        if self.preset == "cli" and self.cli is None:
            raise ValueError("preset cli needs harness.cli: a shipped spec's name (qwen-code, opencode) or a whole "
                             "spec")
        if self.cli is not None and self.preset != "cli":
            raise ValueError(f"cli is for preset cli (preset {self.preset} is a CLI of its own)")
        return self

    @model_validator(mode="after")
    def _command_is_for_reference(self) -> HarnessSection:
        if self.command is not None and self.preset != "reference":
            raise ValueError(f"command is for preset reference; preset {self.preset} builds its own command line "
                             "(add arguments with harness.extra_args)")
        return self
