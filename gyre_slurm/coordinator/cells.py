"""The daemon's view of cells, node agents and role switches, and every ledger write that follows from them.

No sockets here: the daemon feeds messages in (with `now`) and this object updates its state, queues ledger
writes and calls `send(node_index, msg)` for what must go out. Rebuilt from the ledger on restart. Cell roles,
agent statuses and switch statuses change only through their state machines (roles.py, statuses.py): an illegal
change raises IllegalTransition before anything is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import ControlError
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import (
    Heartbeat,
    Register,
    RegisterAck,
    Reregister,
    SwitchReport,
    SwitchRole,
    WeightsRef,
    WireMessage,
)
from gyre_slurm.roles import TARGET_ROLES, Role
from gyre_slurm.slurm_jobs import ENDED
from gyre_slurm.statuses import AGENT, ROLE, SWITCH, AgentStatus, Severity, SwitchStatus


@dataclass
class AgentState:
    node_index: int
    cell: int
    role: Role | None = None
    status: AgentStatus = AgentStatus.UP  # as in the ledger
    last_heartbeat: float = 0.0
    session: bool = False  # registered with *this* daemon process (UP without it: not re-registered yet)
    engine_url: str | None = None  # the rollout engine the node serves, if any
    registered_at: float = 0.0  # by this daemon process: Slurm states read before it are older than the agent

    @property
    def up(self) -> bool:
        return self.status == AgentStatus.UP and self.session

    def shown_status(self) -> str:
        return "UNKNOWN" if self.status == AgentStatus.UP and not self.session else self.status.value


@dataclass
class SwitchState:
    id: int
    cell: int
    from_role: Role
    to_role: Role
    requested_at: float
    pending: set[int]  # node indices not yet done
    reports: dict[int, SwitchReport] = field(default_factory=dict)
    weights: WeightsRef | None = None


@dataclass
class CellState:
    id: int
    role: Role = Role.DOWN
    switch: SwitchState | None = None
    pinned: bool = False  # set by hand: no policy moves it until `gyre cells release`
    slurm_job_id: str | None = None  # the cell's own Slurm job (gyre submit); None when the cell has none
    slurm_state: str | None = None  # that job's state as Slurm last said


Send = Callable[[int, WireMessage], None]


class CellRegistry:
    def __init__(self, cfg: RunConfig, ledger: Ledger, send: Send,
                 weights: Callable[[], WeightsRef | None] = lambda: None, cell_jobs: bool = False) -> None:
        self.cfg = cfg
        self.weights = weights  # the version a cell entering ROLLOUT must serve
        self.ledger = ledger
        self.send = send
        self.npc = cfg.cluster.nodes_per_cell
        self.cells = {c: CellState(c) for c in range(cfg.cluster.cells)}
        self.agents: dict[int, AgentState] = {}
        self._next_switch_id = 1
        self.cell_jobs = cell_jobs  # each cell is a Slurm job of its own (gyre submit): job states are watched

    # --- creation and recovery ----------------------------------------------------------------------------
    def create(self, now: float) -> None:
        for c in self.cells.values():
            self._create_cell(c, now)

    def _create_cell(self, c: CellState, now: float) -> None:
        self.ledger.cell_created(c.id, c.id == self.cfg.cluster.core_cell, self.npc, now)

    def recover(self, now: float) -> None:
        """Rebuild from the ledger. Agents must re-register; until they do their last heartbeat counts as now."""
        for c in self.ledger.cells():
            # cells added while the run went on (`gyre cells add`) are in the ledger only
            self.cells[c.id] = CellState(c.id, c.role, pinned=c.pinned, slurm_job_id=c.slurm_job_id,
                                         slurm_state=c.slurm_state)
        for a in self.ledger.agents():
            self.agents[a.node_index] = AgentState(a.node_index, a.cell_id, a.role, a.status, last_heartbeat=now)
        for row in self.ledger.pending_switches():
            sw = SwitchState(row.id, row.cell_id, row.from_role, row.to_role, row.requested_at,
                             pending=set(self.nodes_of(row.cell_id)))
            self.cells[sw.cell].switch = sw
        self._next_switch_id = self.ledger.last_switch_id() + 1

    # --- helpers ------------------------------------------------------------------------------------------
    def nodes_of(self, cell: int) -> range:
        return range(cell * self.npc, (cell + 1) * self.npc)

    def _set_role(self, cell: CellState, role: Role, now: float, target: Role | None = None) -> None:
        if role == cell.role:
            return
        self.ledger.role_changed(cell.id, cell.role, role, now, target)
        cell.role = role

    def cell_up(self, cell: int) -> bool:
        """Every node agent of the cell registered with this daemon (after a restart: once they came back)."""
        return all(self.agents.get(n) is not None and self.agents[n].up for n in self.nodes_of(cell))

    def _set_agent_status(self, agent: AgentState, status: AgentStatus) -> None:
        self.ledger.transition(AGENT, {"node_index": agent.node_index}, agent.status, status,
                               f"agent of node {agent.node_index}")
        agent.status = status

    # --- agents -------------------------------------------------------------------------------------------
    def register(self, msg: Register, now: float) -> RegisterAck:
        if msg.node_index // self.npc not in self.cells:
            raise ControlError(f"node_index {msg.node_index} out of range: this run has {len(self.cells)} cells of "
                               f"{self.npc} node(s)")
        cell = self.cells[msg.node_index // self.npc]
        prev = self.agents.get(msg.node_index)
        # A new agent takes the role its cell already has (if the cell's other nodes are up), else the initial role.
        peers_up = [a for a in self.agents.values() if a.cell == cell.id and a.up and a.node_index != msg.node_index]
        if msg.role is not None:
            role = msg.role
        elif peers_up and cell.role in TARGET_ROLES:
            role = cell.role
        else:
            role = Role(self.cfg.cluster.initial_role)
        self.ledger.agent_registered(msg.node_index, prev.status if prev is not None else None, cell_id=cell.id,
                                     node_name=msg.node_name, host=msg.host, pid=msg.pid,
                                     slurm_job_id=msg.slurm_job_id, role=role, now=now)
        agent = AgentState(msg.node_index, cell.id, role, AgentStatus.UP, now, session=True, engine_url=msg.engine_url,
                           registered_at=now)
        self.agents[msg.node_index] = agent
        if msg.slurm_job_id and self.cell_jobs and (msg.slurm_job_id, "RUNNING") != (cell.slurm_job_id,
                                                                                     cell.slurm_state):
            self.set_job(cell.id, msg.slurm_job_id, "RUNNING", now)  # its agents run (a job resubmitted by hand too)
        again = "re-registered" if prev is not None else "registered"
        self.ledger.event("agent_registered", f"node {msg.node_index} ({msg.node_name}, pid {msg.pid}) {again} "
                          f"as {role.value}", cell_id=cell.id, node_index=msg.node_index)

        if cell.switch is not None:
            self._reconcile_switch(cell, agent, msg.last_switch, now)
        elif cell.role == Role.SWITCHING:
            self._set_role(cell, role, now)
        if cell.switch is None and self.cell_up(cell.id) and cell.role != role:
            if cell.role in TARGET_ROLES:  # its agents came back holding the other role: the old one is gone
                self.ledger.event("cell_role_reported", f"cell {cell.id} was {cell.role.value}; its agents came "
                                  f"back as {role.value}", severity=Severity.WARNING, cell_id=cell.id)
                self._set_role(cell, Role.DOWN, now)
            self._set_role(cell, role, now)
        return RegisterAck(cell=cell.id, role=role, heartbeat_interval_s=self.cfg.control.heartbeat_interval_s,
                           weights=self.weights())

    def heartbeat(self, msg: Heartbeat, now: float) -> Reregister | None:
        agent = self.agents.get(msg.node_index)
        if agent is None or not agent.session:
            return Reregister(reason="unknown agent (daemon restarted?)")
        if agent.status != AgentStatus.UP:
            return Reregister(reason=f"agent was marked {agent.status.value}")
        agent.last_heartbeat = now
        agent.engine_url = msg.engine_url
        self.ledger.heartbeat(msg.node_index, agent.cell, now, msg.rss_mb)
        return None

    def check_heartbeats(self, now: float) -> list[int]:
        """Mark agents silent for longer than heartbeat_timeout_s LOST and their cells DOWN."""
        lost = []
        timeout = self.cfg.control.heartbeat_timeout_s
        for a in self.agents.values():
            if a.status == AgentStatus.UP and now - a.last_heartbeat > timeout:
                self._lose_agent(a, f"no heartbeat for {now - a.last_heartbeat:.1f} s", now)
                lost.append(a.node_index)
        return lost

    def _lose_agent(self, a: AgentState, why: str, now: float) -> None:
        self._set_agent_status(a, AgentStatus.LOST)
        a.session = False
        self.ledger.event("agent_lost", f"node {a.node_index}: {why}", severity=Severity.ERROR, cell_id=a.cell,
                          node_index=a.node_index)
        cell = self.cells[a.cell]
        if cell.switch is not None:
            self._finish_switch(cell, now, ok=False, error=f"agent of node {a.node_index} lost")
        self._set_role(cell, Role.DOWN, now)

    # --- cells as Slurm jobs (gyre submit) ----------------------------------------------------------------
    def set_job(self, cell_id: int, job: str, state: str, now: float) -> None:
        """The cell's Slurm job (just submitted, or the one its agents registered from)."""
        if cell_id not in self.cells:
            raise ControlError(f"no cell {cell_id}: this run has cells 0..{len(self.cells) - 1}")
        cell = self.cells[cell_id]
        cell.slurm_job_id, cell.slurm_state = job, state
        self.ledger.cell_job(cell_id, state, now, job=job)
        self.ledger.event("cell_job", f"cell {cell_id}: Slurm job {job} ({state})", cell_id=cell_id,
                          data={"job": job, "state": state})

    def slurm_states(self, states: dict[str, tuple[str, float]], now: float) -> None:
        """What Slurm says of the cells' jobs: a change is logged, and a cell whose job stopped running (cancelled,
        failed, preempted, requeued) is DOWN now rather than after the heartbeat timeout. An answer read before the
        cell's agents registered says nothing about them (a requeued job's new start)."""
        for cell in self.cells.values():
            got = states.get(cell.slurm_job_id or "")
            if got is None:
                continue
            state, read_at = got
            if state != cell.slurm_state:
                cell.slurm_state = state
                self.ledger.cell_job(cell.id, state, now)
                self.ledger.event("cell_job", f"cell {cell.id}: Slurm job {cell.slurm_job_id} is {state}",
                                  severity=Severity.WARNING if state not in ("PENDING", "RUNNING") else Severity.INFO,
                                  cell_id=cell.id, data={"job": cell.slurm_job_id, "state": state})
            if state == "RUNNING":
                continue
            for n in self.nodes_of(cell.id):
                a = self.agents.get(n)
                if a is not None and a.status == AgentStatus.UP and a.registered_at < read_at:
                    self._lose_agent(a, f"its Slurm job {cell.slurm_job_id} is {state}", now)

    def add_cells(self, n: int, now: float) -> list[int]:
        """`gyre cells add`: n cells for new jobs — DOWN cells whose job is over first (the core before the others),
        then new ids. A new cell starts DOWN and joins when its agents register."""
        if not self.cell_jobs:
            raise ControlError("this run's cells are not Slurm jobs of their own (started by `gyre run` or one "
                               "sbatch allocation): only a run started with `gyre submit` can add cells")
        if n < 1:
            raise ControlError(f"add at least one cell, not {n}")
        core = self.cfg.cluster.core_cell
        free = sorted((c.id for c in self.cells.values() if c.role == Role.DOWN and not self.cell_up(c.id)
                       and (c.slurm_job_id is None or c.slurm_state in ENDED)), key=lambda c: (c != core, c))[:n]
        ids = list(free)
        while len(ids) < n:
            cell = CellState(max(self.cells) + 1)
            self.cells[cell.id] = cell
            self._create_cell(cell, now)
            ids.append(cell.id)
        self.ledger.event("cells_added", f"{n} cell(s) for new Slurm jobs: {', '.join(map(str, ids))}"
                          + (f" (reusing DOWN {', '.join(map(str, free))})" if free else ""), data={"cells": ids})
        return ids

    def mark_stopped(self, now: float) -> None:
        for a in self.agents.values():
            if a.status == AgentStatus.UP:
                self._set_agent_status(a, AgentStatus.STOPPED)
        for c in self.cells.values():
            self.ledger.spans_ended(c.id, now)

    # --- role switches ------------------------------------------------------------------------------------
    def request_switch(self, cell_id: int, target: Role, reason: str, now: float) -> int:
        """Start a switch of every node of the cell; a cell entering ROLLOUT serves the current weights."""
        if cell_id not in self.cells:
            raise ControlError(f"no cell {cell_id}: this run has cells 0..{len(self.cells) - 1}")
        if target not in TARGET_ROLES:
            raise ControlError(f"a cell can be switched to ROLLOUT or TRAIN, not {target.value}")
        cell = self.cells[cell_id]
        if cell.switch is not None or cell.role == Role.SWITCHING:
            raise ControlError(f"cell {cell_id} is already switching")
        if cell.role == Role.DOWN or not self.cell_up(cell_id):
            raise ControlError(f"cell {cell_id} is DOWN (not all of its node agents are up)")
        if cell.role == target:
            raise ControlError(f"cell {cell_id} is already {target.value}")
        if not ROLE.allowed(cell.role, Role.SWITCHING):
            raise ControlError(f"cell {cell_id} cannot switch from {cell.role.value}")
        weights = self.weights() if target == Role.ROLLOUT else None
        sw = SwitchState(self._next_switch_id, cell_id, cell.role, target, now, pending=set(self.nodes_of(cell_id)),
                         weights=weights)
        self._next_switch_id += 1
        ROLE.check(cell.role, Role.SWITCHING, f"cell {cell_id}")  # before anything is written
        self.ledger.transition(SWITCH, {"id": sw.id}, None, SwitchStatus.PENDING, f"switch {sw.id}",
                               cell_id=cell_id, from_role=sw.from_role.value, to_role=target.value, reason=reason,
                               requested_at=now, started_at=None, ended_at=None, duration_s=None, error=None)
        self.ledger.event("switch_requested", f"cell {cell_id}: {sw.from_role.value} → {target.value} ({reason})",
                          cell_id=cell_id, data={"switch_id": sw.id})
        cell.switch = sw
        self._set_role(cell, Role.SWITCHING, now, target=target)
        for n in sw.pending:
            self.send(n, SwitchRole(switch_id=sw.id, cell=cell_id, target=target, weights=weights))
        return sw.id

    def pin(self, cell_id: int, target: Role, now: float) -> int | None:
        """`gyre cells reassign`: move the cell by hand (if it is not in `target` already) and pin it there."""
        if cell_id not in self.cells:
            raise ControlError(f"no cell {cell_id}: this run has cells 0..{len(self.cells) - 1}")
        cell = self.cells[cell_id]
        moving = cell.switch.to_role if cell.switch is not None else cell.role
        if moving == target and cell.pinned:
            raise ControlError(f"cell {cell_id} is already {target.value} and pinned")
        switch_id = None if moving == target else self.request_switch(cell_id, target, reason="manual", now=now)
        self._set_pinned(cell, True, f"cell {cell_id} pinned to {target.value} by hand: no policy moves it until "
                                     f"`gyre cells release`", now)
        return switch_id

    def release(self, cell_id: int, now: float) -> None:
        """`gyre cells release`: the policy may move the cell again."""
        if cell_id not in self.cells:
            raise ControlError(f"no cell {cell_id}: this run has cells 0..{len(self.cells) - 1}")
        cell = self.cells[cell_id]
        if not cell.pinned:
            raise ControlError(f"cell {cell_id} is not pinned")
        self._set_pinned(cell, False, f"cell {cell_id} released: the policy may move it again", now)

    def _set_pinned(self, cell: CellState, pinned: bool, message: str, now: float) -> None:
        cell.pinned = pinned
        self.ledger.cell_pinned(cell.id, pinned, now)
        self.ledger.event("cell_pinned" if pinned else "cell_released", message, cell_id=cell.id)

    def switch_done(self, node_index: int, report: SwitchReport, now: float) -> None:
        agent = self.agents.get(node_index)
        cell = self.cells[agent.cell] if agent else None
        sw = cell.switch if cell else None
        if sw is None or sw.id != report.switch_id or node_index not in sw.pending:
            return  # a duplicate or late report (e.g. replayed after a daemon restart): already accounted for
        sw.pending.discard(node_index)
        sw.reports[node_index] = report
        agent.role = report.role
        self.ledger.agent_role(node_index, report.role)
        if not report.ok:
            self._finish_switch(cell, now, ok=False, error=report.error or "switch failed on the node")
        elif not sw.pending:
            self._finish_switch(cell, now, ok=True)

    def _reconcile_switch(self, cell: CellState, agent: AgentState, last: SwitchReport | None, now: float) -> None:
        sw = cell.switch
        assert sw is not None
        if last is not None and last.switch_id == sw.id:
            self.switch_done(agent.node_index, last, now)
        elif agent.node_index in sw.pending:
            # The node never got (or never finished) the command: send it again; agents apply it idempotently. With
            # the weights whatever the target: a fresh agent (a resumed run) has none, and the core trains from them.
            self.send(agent.node_index, SwitchRole(switch_id=sw.id, cell=cell.id, target=sw.to_role,
                                                   weights=sw.weights or self.weights()))

    def check_switch_timeouts(self, now: float) -> None:
        limit = self.cfg.control.switch_timeout_s
        for cell in self.cells.values():
            if cell.switch is not None and now - cell.switch.requested_at > limit:
                self._finish_switch(cell, now, ok=False, error=f"not finished within {limit:.0f} s")

    def _finish_switch(self, cell: CellState, now: float, ok: bool, error: str | None = None) -> None:
        sw = cell.switch
        assert sw is not None
        started = min((r.started_at for r in sw.reports.values()), default=None)
        ended = max((r.ended_at for r in sw.reports.values()), default=None) if ok else now
        self.ledger.transition(SWITCH, {"id": sw.id}, SwitchStatus.PENDING,
                               SwitchStatus.DONE if ok else SwitchStatus.FAILED, f"switch {sw.id}", started_at=started,
                               ended_at=ended, duration_s=(ended - sw.requested_at) if ended else None, error=error)
        cell.switch = None
        if ok:
            self.ledger.event("switch_done", f"cell {cell.id}: {sw.from_role.value} → {sw.to_role.value} in "
                              f"{ended - sw.requested_at:.3f} s", cell_id=cell.id, data={"switch_id": sw.id})
            self._set_role(cell, sw.to_role, now)
        else:
            self.ledger.event("switch_failed", f"cell {cell.id}: {error}", severity=Severity.ERROR, cell_id=cell.id,
                              data={"switch_id": sw.id})
            roles = {self.agents[n].role for n in self.nodes_of(cell.id) if n in self.agents}
            settled = roles.pop() if len(roles) == 1 else None
            self._set_role(cell, settled if settled in TARGET_ROLES and self.cell_up(cell.id) else Role.DOWN,
                           now)

    def rollout_slots(self) -> list[tuple[int, str]]:
        """(cell, engine URL) of every ROLLOUT cell whose engine is up (the cell's first node serves it)."""
        out = []
        for c in self.cells.values():
            lead = self.agents.get(c.id * self.npc)
            if c.role == Role.ROLLOUT and lead is not None and lead.up and lead.engine_url:
                out.append((c.id, lead.engine_url))
        return out

    def core_node(self) -> int:
        return self.cfg.cluster.core_cell * self.npc

    # --- views for control replies ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        now = time.time()
        return {
            "cells": [
                {"cell": c.id, "role": c.role.value, "pinned": c.pinned,
                 "target": c.switch.to_role.value if c.switch else None,
                 "agents_up": sum(1 for n in self.nodes_of(c.id) if n in self.agents and self.agents[n].up),
                 "nodes": self.npc}
                for c in self.cells.values()
            ],
            "agents": [
                {"node": a.node_index, "cell": a.cell, "status": a.shown_status(),
                 "role": a.role.value if a.role else None, "heartbeat_age_s": round(now - a.last_heartbeat, 2)}
                for a in sorted(self.agents.values(), key=lambda a: a.node_index)
            ],
        }
