"""When a request is finished and what its answer says: SGLang's finish rules and /generate response shape
(schedule_batch.py Req.check_finished, detokenizer_manager.py trim_matched_stop, tokenizer_manager.py meta_info)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gyre_slurm.engines.inflight import Request

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ABORTED: dict[str, Any] = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def finish_reason(req: Request, eos_ids: frozenset[int], tokenizer: Tokenizer | None) -> dict | None:
    """SGLang's order: length, then stop tokens (unless ignore_eos), then stop strings; None while running."""
    s, out = req.inp.sampling, req.output_ids
    if len(out) >= s.max_new_tokens:
        return {"type": "length", "length": s.max_new_tokens}
    last = out[-1]
    if not s.ignore_eos and (last in s.stop_token_ids or last in eos_ids):
        return {"type": "stop", "matched": last}
    if s.stop and tokenizer is not None:  # validation refuses stop strings without a tokenizer
        if not req.stop_len:
            req.stop_len = max(len(tokenizer.encode(x, add_special_tokens=False).ids) for x in s.stop)
        tail = tokenizer.decode(out[-(req.stop_len + 1):], skip_special_tokens=False)
        for stop in s.stop:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    return None


def response_text(req: Request, reason: dict, tokenizer: Tokenizer | None) -> str:
    """A matched stop token is left out of the text, a matched stop string cut with what follows it, unless
    no_stop_trim; output_ids keep both."""
    if tokenizer is None:
        return ""
    s, out, matched = req.inp.sampling, req.output_ids, reason.get("matched")
    ids = out[:-1] if reason.get("type") == "stop" and isinstance(matched, int) and not s.no_stop_trim else out
    text = tokenizer.decode(ids, skip_special_tokens=s.skip_special_tokens)
    if isinstance(matched, str) and not s.no_stop_trim and matched in text:
        text = text[: text.index(matched)]
    return text


def response(req: Request, reason: dict, tokenizer: Tokenizer | None, weight_version: str) -> dict[str, Any]:
    """The /generate answer: {"text", "output_ids", "meta_info"}; logprobs as [[logprob, token_id, text], ...]."""
    out = req.output_ids
    meta: dict[str, Any] = {
        "id": req.inp.rid,
        "finish_reason": reason,
        "prompt_tokens": len(req.inp.input_ids),
        "weight_version": weight_version,
    }
    if req.inp.return_logprob:
        texts: list[str | None] = [None] * len(out)
        if req.inp.return_text_in_logprobs and tokenizer is not None:
            texts = [tokenizer.decode([t], skip_special_tokens=False) for t in out]
        meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(req.logprobs, out, texts, strict=True)]
    meta.update(completion_tokens=len(out), cached_tokens=req.cached_tokens,
                e2e_latency=time.monotonic() - req.created)
    return {"text": response_text(req, reason, tokenizer), "output_ids": list(out), "meta_info": meta}
