"""Policy models: the built-in tiny Qwen3, a pure-torch Qwen3 forward, and where version 0 comes from."""


def quiet_transformers() -> None:
    """No per-file progress bars from transformers in a run's output (they say nothing a user needs)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
