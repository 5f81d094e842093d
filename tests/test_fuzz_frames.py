"""Fuzzed control frames (tools/fuzz_frames.py, tools/frame_mutations.py): the generator covers every message type
and only returns frames the protocol refuses; 1,000 of them to each of the real daemon, a node agent and a proxy's
daemon link crash nothing, hang nothing, are each recorded, and leave the run as it was."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_slurm.errors import ProtocolError
from gyre_slurm.protocol import decode, encode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from frame_mutations import MUTATIONS, SAMPLES, Mutator, message_types, stale  # noqa: E402

TOKEN = "run-token-for-the-fuzz-tests"


def test_the_samples_are_one_valid_message_of_every_type() -> None:
    assert {type(s) for s in SAMPLES} == message_types()
    for s in SAMPLES:
        assert decode(encode(s, TOKEN), TOKEN) == s


def test_every_mutated_frame_is_refused_with_a_short_reason() -> None:
    m = Mutator(TOKEN, seed=3)
    for _ in range(600):
        _name, frame = m.frame()
        with pytest.raises(ProtocolError) as e:
            decode(frame, TOKEN)
        assert len(str(e.value)) <= 300  # a 4 MB string in a field is not quoted whole in logs and events
    assert all(n > 0 for n in m.counts.values()), m.counts  # every mutation drawn
    assert set(m.counts) == set(MUTATIONS)


def test_stale_frames_are_valid_and_name_nothing_real() -> None:
    for target in ("daemon", "agent", "proxy"):
        for _kind, frame in stale(TOKEN, 0, 50, target):
            msg = decode(frame, TOKEN)
            for field in ("rollout_id", "step", "node_index", "cell", "attempt", "switch_id"):
                value = getattr(msg, field, None)
                assert value is None or value >= 10**6, (target, msg)


@pytest.mark.slow
def test_a_thousand_fuzzed_frames_to_each_target_change_nothing() -> None:
    r = subprocess.run([sys.executable, str(REPO / "tools" / "fuzz_frames.py"), "--frames", "1000", "--load-s", "5"],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr[-3000:])
    rows = {m.group(1): tuple(int(x.replace(",", "")) for x in m.group(2, 3, 4, 5, 6, 7))
            for m in re.finditer(r"^(daemon|agent|proxy)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+(\d+)\s+(\d+)",
                                 out, re.M)}
    assert set(rows) == {"daemon", "agent", "proxy"}, out
    for target, (frames, refused, recorded, n_stale, crashes, hangs) in rows.items():
        assert frames == 1000 and refused == recorded and refused + n_stale == frames, (target, out)
        assert n_stale > 0 and crashes == 0 and hangs == 0, (target, out)
    assert out.splitlines()[-1].startswith("fuzz: OK: 3,000 frames"), out
