"""The daemon's cell registry, without processes: registration, switches, loss and recovery, on a real ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_slurm.config import parse_config
from gyre_slurm.coordinator.cells import CellRegistry
from gyre_slurm.errors import ControlError
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import Heartbeat, Register, Reregister, SwitchReport, SwitchRole
from gyre_slurm.roles import Role


class Net:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def __call__(self, node: int, msg: object) -> None:
        self.sent.append((node, msg))


def make(tmp_path: Path, cells: int = 2, npc: int = 1):
    cfg = parse_config({"run": {"name": "t"}, "cluster": {"cells": cells, "nodes_per_cell": npc},
                        "control": {"heartbeat_interval_s": 1, "heartbeat_timeout_s": 5, "switch_timeout_s": 30}})
    ledger = Ledger(tmp_path / "ledger.db")
    net = Net()
    reg = CellRegistry(cfg, ledger, net)
    reg.create(0.0)
    return cfg, ledger, net, reg


def reg_msg(node: int, role: Role | None = None, last: SwitchReport | None = None) -> Register:
    return Register(node_index=node, node_name=f"node{node + 1}", host="h", pid=100 + node, role=role,
                    last_switch=last)


def test_cells_come_up_when_all_their_agents_register(tmp_path: Path) -> None:
    _, ledger, _, reg = make(tmp_path, cells=2, npc=2)
    assert reg.register(reg_msg(0), 1.0).role == Role.ROLLOUT
    assert reg.cells[0].role == Role.DOWN  # one of two nodes
    assert reg.register(reg_msg(1), 1.1).cell == 0
    assert reg.cells[0].role == Role.ROLLOUT
    with pytest.raises(ControlError, match="out of range"):
        reg.register(reg_msg(4), 1.2)
    assert ledger.rows("SELECT role FROM cells WHERE id = 0")[0]["role"] == "ROLLOUT"
    spans = ledger.rows("SELECT role, started_at, ended_at FROM cell_spans WHERE cell_id = 0 ORDER BY id")
    assert spans == [{"role": "DOWN", "started_at": 0.0, "ended_at": 1.1},
                     {"role": "ROLLOUT", "started_at": 1.1, "ended_at": None}]


def test_switch_lifecycle_is_timed_in_the_ledger(tmp_path: Path) -> None:
    _, ledger, net, reg = make(tmp_path)
    reg.register(reg_msg(0), 1.0)
    reg.register(reg_msg(1), 1.0)
    sid = reg.request_switch(1, Role.TRAIN, "manual", 10.0)
    assert net.sent[-1] == (1, SwitchRole(switch_id=sid, cell=1, target=Role.TRAIN))
    assert reg.cells[1].role == Role.SWITCHING
    for bad, why in [((1, Role.ROLLOUT), "already switching"), ((0, Role.ROLLOUT), "already ROLLOUT"),
                     ((5, Role.TRAIN), "no cell 5"), ((0, Role.DOWN), "ROLLOUT or TRAIN")]:
        with pytest.raises(ControlError, match=why):
            reg.request_switch(*bad, "manual", 11.0)
    reg.switch_done(1, SwitchReport(switch_id=sid, role=Role.TRAIN, ok=True, started_at=10.1, ended_at=12.5), 12.6)
    assert reg.cells[1].role == Role.TRAIN
    row = ledger.rows("SELECT * FROM role_switches")[0]
    assert (row["status"], row["from_role"], row["to_role"]) == ("DONE", "ROLLOUT", "TRAIN")
    assert row["duration_s"] == pytest.approx(2.5) and row["started_at"] == 10.1
    # a duplicate report (e.g. replayed) changes nothing
    reg.switch_done(1, SwitchReport(switch_id=sid, role=Role.TRAIN, ok=True, started_at=10.1, ended_at=99), 100)
    assert ledger.rows("SELECT ended_at FROM role_switches")[0]["ended_at"] == 12.5
    times = {(r["cell"], r["role"]): r["seconds"] for r in ledger.rows("SELECT * FROM v_cell_role_time")}
    assert times[(1, "SWITCHING")] == pytest.approx(2.6)


def test_failed_switch_leaves_the_cell_where_the_node_says(tmp_path: Path) -> None:
    _, ledger, _, reg = make(tmp_path)
    reg.register(reg_msg(0), 1.0)
    reg.register(reg_msg(1), 1.0)
    sid = reg.request_switch(0, Role.TRAIN, "manual", 2.0)
    reg.switch_done(0, SwitchReport(switch_id=sid, role=Role.ROLLOUT, ok=False, started_at=2, ended_at=3,
                                    error="OOM"), 3.0)
    assert reg.cells[0].role == Role.ROLLOUT
    row = ledger.rows("SELECT status, error FROM role_switches")[0]
    assert row == {"status": "FAILED", "error": "OOM"}


def test_lost_agent_marks_the_cell_down_and_fails_its_switch(tmp_path: Path) -> None:
    _, ledger, _, reg = make(tmp_path)
    reg.register(reg_msg(0), 1.0)
    reg.register(reg_msg(1), 1.0)
    reg.request_switch(1, Role.TRAIN, "manual", 2.0)
    assert reg.heartbeat(Heartbeat(node_index=0, cell=0, role=Role.ROLLOUT, seq=1), 4.0) is None
    assert reg.check_heartbeats(5.0) == []
    assert reg.check_heartbeats(6.5) == [1]  # node 1 silent since 1.0, timeout 5 s
    assert reg.cells[1].role == Role.DOWN and reg.cells[0].role == Role.ROLLOUT
    assert ledger.rows("SELECT status FROM agents WHERE node_index = 1")[0]["status"] == "LOST"
    assert ledger.rows("SELECT status FROM role_switches")[0]["status"] == "FAILED"
    assert ledger.rows("SELECT count(*) AS n FROM events WHERE kind = 'agent_lost'")[0]["n"] == 1
    # a lost agent that speaks again is asked to register, then its cell is back
    assert isinstance(reg.heartbeat(Heartbeat(node_index=1, cell=1, role=Role.TRAIN, seq=2), 7.0), Reregister)
    reg.register(reg_msg(1, role=Role.TRAIN), 7.1)
    assert reg.cells[1].role == Role.TRAIN
    assert ledger.rows("SELECT registrations FROM agents WHERE node_index = 1")[0]["registrations"] == 2


def test_recovery_closes_a_switch_the_node_finished_while_the_daemon_was_down(tmp_path: Path) -> None:
    cfg, ledger, _, reg = make(tmp_path)
    reg.register(reg_msg(0), 1.0)
    reg.register(reg_msg(1), 1.0)
    sid = reg.request_switch(0, Role.TRAIN, "manual", 2.0)
    ledger.flush()  # the daemon dies here; the node finishes its switch meanwhile
    net2 = Net()
    reg2 = CellRegistry(cfg, Ledger(tmp_path / "ledger.db"), net2)
    reg2.recover(50.0)
    assert reg2.cells[0].role == Role.SWITCHING and reg2.cells[0].switch.id == sid
    assert isinstance(reg2.heartbeat(Heartbeat(node_index=0, cell=0, role=Role.TRAIN, seq=5), 50.1), Reregister)
    done = SwitchReport(switch_id=sid, role=Role.TRAIN, ok=True, started_at=2.1, ended_at=4.0)
    reg2.register(reg_msg(0, role=Role.TRAIN, last=done), 50.2)
    reg2.register(reg_msg(1, role=Role.ROLLOUT), 50.2)
    assert reg2.cells[0].role == Role.TRAIN and reg2.cells[1].role == Role.ROLLOUT
    row = reg2.ledger.rows("SELECT status, duration_s FROM role_switches")[0]
    assert row["status"] == "DONE" and row["duration_s"] == pytest.approx(2.0)
    # a node that never got the command is sent it again
    sid2 = reg2.request_switch(1, Role.TRAIN, "manual", 60.0)
    reg2.ledger.flush()
    reg3 = CellRegistry(cfg, Ledger(tmp_path / "ledger.db"), net3 := Net())
    reg3.recover(70.0)
    reg3.register(reg_msg(1, role=Role.ROLLOUT), 70.1)
    assert net3.sent == [(1, SwitchRole(switch_id=sid2, cell=1, target=Role.TRAIN))]
    assert reg3.ledger.scalar("SELECT count(*) FROM role_switches") == 2


def _jobs(reg: CellRegistry, ledger: Ledger) -> None:
    reg.cell_jobs = True
    for cell in (0, 1):
        reg.set_job(cell, str(100 + cell), "PENDING", 0.5)
        reg.register(Register(node_index=cell, node_name="n", host="h", pid=1, slurm_job_id=str(100 + cell)), 1.0)


def test_a_cell_whose_slurm_job_stops_running_is_down_at_once(tmp_path: Path) -> None:
    """gyre submit: the daemon reads its cell jobs' states; one that stopped running makes its cell DOWN before any
    heartbeat timeout, with the job's state in the ledger; an answer older than a registration changes nothing."""
    _, ledger, _, reg = make(tmp_path)
    _jobs(reg, ledger)
    assert ledger.rows("SELECT slurm_job_id, slurm_state FROM cells ORDER BY id") == [
        {"slurm_job_id": "100", "slurm_state": "RUNNING"}, {"slurm_job_id": "101", "slurm_state": "RUNNING"}]
    reg.slurm_states({"100": ("RUNNING", 2.0), "101": ("CANCELLED", 2.0)}, 2.1)
    assert [reg.cells[c].role for c in (0, 1)] == [Role.ROLLOUT, Role.DOWN]
    assert ledger.rows("SELECT status FROM agents WHERE node_index = 1") == [{"status": "LOST"}]
    assert "its Slurm job 101 is CANCELLED" in ledger.scalar("SELECT message FROM events WHERE kind = 'agent_lost'")
    # requeued: PENDING, then the job runs again and its agent registers; a PENDING read before that is stale
    reg.register(Register(node_index=1, node_name="n", host="h", pid=2, slurm_job_id="101"), 3.0)
    reg.slurm_states({"101": ("PENDING", 2.5)}, 3.1)
    assert reg.cells[1].role == Role.ROLLOUT
    reg.slurm_states({"101": ("PENDING", 3.5)}, 3.6)  # read after it registered: the job really stopped
    assert reg.cells[1].role == Role.DOWN


def test_cells_add_reuses_down_cells_whose_job_is_over_then_grows(tmp_path: Path) -> None:
    cfg, ledger, _, reg = make(tmp_path)
    with pytest.raises(ControlError, match="only a run started with `gyre submit`"):
        reg.add_cells(1, 1.0)
    _jobs(reg, ledger)
    reg.slurm_states({"100": ("CANCELLED", 2.0)}, 2.1)  # the core's job: it comes back first
    assert reg.add_cells(3, 3.0) == [0, 2, 3]
    assert sorted(reg.cells) == [0, 1, 2, 3] and reg.cells[3].role == Role.DOWN
    with pytest.raises(ControlError, match="at least one"):
        reg.add_cells(0, 3.0)
    reg.set_job(3, "107", "PENDING", 3.1)
    ack = reg.register(Register(node_index=3, node_name="n", host="h", pid=3, slurm_job_id="107"), 4.0)
    assert ack.cell == 3 and reg.cells[3].role == Role.ROLLOUT
    with pytest.raises(ControlError, match="out of range: this run has 4 cells"):
        reg.register(reg_msg(4), 4.1)
    ledger.flush()
    # a restarted daemon knows the added cells and their jobs from the ledger
    reg2 = CellRegistry(cfg, Ledger(tmp_path / "ledger.db"), Net())
    reg2.recover(5.0)
    assert sorted(reg2.cells) == [0, 1, 2, 3]
    assert (reg2.cells[3].slurm_job_id, reg2.cells[3].role) == ("107", Role.ROLLOUT)
    assert (reg2.cells[0].slurm_state, reg2.cells[1].slurm_job_id) == ("CANCELLED", "101")
