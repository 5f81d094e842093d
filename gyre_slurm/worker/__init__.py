"""The harness worker: runs agent harnesses then evaluators for the daemon (above harness/ and scoring/)."""
