"""A coding-agent CLI described by configuration alone (`harness.preset: cli`): how to install it, start it
headless on one run, and point it at the proxy.

Any CLI that speaks the OpenAI or the Anthropic API and runs without a terminal fits: where it comes from and its
exact version, either an npm package (`npm:`; `gyre harness install NAME` installs it beside the other CLIs, on the
same Node) or a PyPI distribution (`pip:`; installed into a virtual environment of its own, harness/install.py), its
argv, the variables and the files under the run's own HOME that carry the proxy's address, the run's key and the
model name, and its shell tool (the warm-up's demonstrations call it). The specs shipped in `cli_specs/` (Qwen Code,
opencode from npm; mini-swe-agent from PyPI) are the examples; `harness.cli` takes a shipped spec's name or a whole
spec.

Placeholders, replaced when a run starts (harness/presets.py):
  in argv only, whole elements:  {binary} (the installed command), {prompt} (the task, one argument, never spliced)
  in argv, env and files:        {base_url} (the proxy's OpenAI base URL, …/v1), {base_root} (without /v1: what
                                 Anthropic clients take), {api_key} (the run's key), {model}, {max_turns},
                                 {max_tokens}, {home} (the run's HOME), {workspace}
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gyre_slurm.errors import GyreError

SPECS_DIR = Path(__file__).with_name("cli_specs")
WHOLE = ("{binary}", "{prompt}")  # argv elements replaced whole
SPLICED = ("{base_url}", "{base_root}", "{api_key}", "{model}", "{max_turns}", "{max_tokens}", "{home}",
           "{workspace}")
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
_PIP_PIN = re.compile(r"(?P<name>[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)(\[[A-Za-z0-9._,-]+\])?==(?P<version>.+)")
_NAMES = ("reference", "claude-code", "codex", "node", "all")  # taken by the presets and `gyre harness install`
_SHAPES = {
    "name": (r"[a-z0-9][a-z0-9-]{0,39}",
             f"must be 1-40 lowercase letters, digits, '-', and none of {', '.join(_NAMES)}"),
    "version": (r"\d+\.\d+\.\d+([-+][0-9A-Za-z.-]+)?",
                "is not an exact version (x.y.z): a range would change the CLI under a run"),
    # PEP 440's release versions (1.2, 1.2.3, 2.0rc1, 1.0.post1): an exact `==` pin, never a range or a URL
    "pip_version": (r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?",
                    "is not an exact version (e.g. 1.2.3): a range would change the CLI under a run"),
    # a PyPI name (PEP 508): nothing pip could read as an option, a path or a URL
    "pip": (r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", "is not a PyPI distribution name"),
    "binary": (r"[A-Za-z0-9][A-Za-z0-9._-]*", "must be a command name, not a path"),
}


class ShellTool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, description="The tool's name in the CLI's tool schemas (e.g. run_shell_command).")
    argument: str = Field(min_length=1, description="Its argument that holds the command line (e.g. command).")


class CliSpec(BaseModel):
    """One CLI, as `harness.cli` gives it (every field is documented in docs/proxy-and-harnesses.md, "Add a CLI by
    config")."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="Its name: `gyre harness install NAME`, the model folder's name.")
    npm: str | None = Field(None, description="The npm package (installed unmodified under <state_dir>/harness/); "
                                              "give npm or pip, not both.")
    pip: str | None = Field(None, description="The PyPI distribution (installed unmodified into a virtual "
                                              "environment of its own, <state_dir>/harness/pip/<name>/).")
    version: str = Field(description="The exact version installed (a pin: runs of one checkout use one build).")
    pip_extra: list[str] = Field(default_factory=list, description="pip: more requirements installed with it, each "
                                 "pinned exactly (name==version): the dependencies that shape its requests when its "
                                 "own requirements are ranges.")
    binary: str = Field(description="Its command: in node_modules/.bin/ (npm), in its environment's bin/ (pip).")
    api: Literal["openai", "anthropic"] = Field(description="The API it speaks to the proxy.")
    argv: list[str] = Field(description="The command line of one run: {binary} first, {prompt} once.")
    env: dict[str, str] = Field(default_factory=dict, description="Variables set for the run (templated).")
    files: dict[str, str] = Field(default_factory=dict, description="Files written under the run's HOME before it "
                                                                    "starts: relative path → text (templated).")
    shell_tool: ShellTool = Field(description="The CLI's shell tool, which the warm-up's demonstrations call.")
    finish: str | None = Field(None, min_length=1, description="The shell command with which its policy ends a run, "
                               "for a CLI that ends on a command rather than on a reply without a tool call "
                               "(mini-swe-agent); the warm-up's demonstrations end with it.")
    policy_stops: list[Annotated[str, StringConstraints(strip_whitespace=True, min_length=8)]] = Field(
        default_factory=list, description="Starts of the lines it prints when it ends a run for the policy's "
        "behaviour (a loop guard, a turn budget): such a run is scored from its workspace, not excluded.")
    approx_mb: int = Field(0, ge=0, description="What its first install downloads (MB), for the progress line.")

    @field_validator("name", "pip", "version", "binary")
    @classmethod
    def _shaped(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        # npm's versions are semver (x.y.z); PyPI's are PEP 440 (pip comes before version: its value is known)
        shape = "pip_version" if info.field_name == "version" and info.data.get("pip") else info.field_name
        pattern, says = _SHAPES[shape]
        if not re.fullmatch(pattern, v) or (info.field_name == "name" and v in _NAMES):
            raise ValueError(f"{v!r} {says}")
        return v

    @field_validator("pip_extra")
    @classmethod
    def _pins(cls, v: list[str]) -> list[str]:
        for req in v:
            m = _PIP_PIN.fullmatch(req)
            if m is None or not re.fullmatch(_SHAPES["pip_version"][0], m["version"]):
                raise ValueError(f"{req!r} is not an exact pin (name==version)")
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            p = PurePosixPath(path)
            if p.is_absolute() or not p.parts or ".." in p.parts:
                raise ValueError(f"{path!r} must be a relative path inside the run's HOME")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> CliSpec:
        if (self.npm is None) == (self.pip is None):
            raise ValueError("give exactly one of npm (an npm package) and pip (a PyPI distribution)")
        if self.pip_extra and self.pip is None:
            raise ValueError("pip_extra is for a pip CLI")
        if not self.argv or self.argv[0] != "{binary}":
            raise ValueError("argv must start with {binary}")
        if self.argv.count("{prompt}") != 1:
            raise ValueError("argv must hold {prompt} once, as a whole element")
        for where, texts in (("argv", self.argv), ("env", [*self.env.values()]), ("files", [*self.files.values()])):
            for text in texts:
                for ph in _PLACEHOLDER.findall(text):
                    if ph in WHOLE and (where != "argv" or text != ph):
                        raise ValueError(f"{ph} goes in argv only, as a whole element (in {where}: {text!r})")
                    if ph not in WHOLE and ph not in SPLICED:
                        raise ValueError(f"unknown placeholder {ph} in {where} (known: {', '.join(WHOLE + SPLICED)})")
        return self


def fill(text: str, values: dict[str, str]) -> str:
    """`text` with each spliced placeholder replaced (a value is inserted as it is)."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(0), m.group(0)), text)


def load_spec_file(path: Path) -> CliSpec:
    try:
        doc = yaml.safe_load(Path(path).read_text())
        return CliSpec.model_validate(doc)
    except (OSError, yaml.YAMLError) as e:
        raise GyreError(f"CLI spec {path}: {e}") from None
    except ValidationError as e:
        first = e.errors()[0]
        raise GyreError(f"CLI spec {path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


@cache
def shipped() -> dict[str, CliSpec]:
    """The specs shipped with the package (cli_specs/*.yaml), by name."""
    specs = [load_spec_file(p) for p in sorted(SPECS_DIR.glob("*.yaml"))]
    return {s.name: s for s in specs}


def resolve(value: str | dict | CliSpec) -> CliSpec:
    """A shipped spec's name, or a whole spec (a mapping), as a CliSpec; GyreError in one line otherwise."""
    if isinstance(value, CliSpec):
        return value
    if isinstance(value, str):
        try:
            return shipped()[value]
        except KeyError:
            raise GyreError(f"no shipped CLI spec {value!r} (shipped: {', '.join(shipped())}); or give a whole "
                            "spec as a mapping") from None
    return CliSpec.model_validate(value)
