"""Rollout engines. The embedded one is a torch Qwen3 served over SGLang's native HTTP routes, with SGLang's JSON
shapes; the proxy and the node agents talk to it exactly as to an SGLang server (`client.py` is the one client for
both), so everything above the engine is tested on CPU with the same wire format it meets on a cluster.

The embedded engine, one module per concern (started as a process with `gyre engine`):
  serve.py         load the model, listen, write the ready file, run uvicorn until SIGTERM
  http_api.py      the FastAPI app: SGLang's routes and error shape
  validation.py    pydantic models of every request body; /generate's checks against the model's limits
  model_thread.py  the model thread: admit, chunked prefill, batched decode, finish, abort, control commands
  inflight.py      what the model thread holds per request and per command, and how it answers them
  outputs.py       SGLang's finish rules and /generate response
  sampling.py      temperature / top-k / top-p sampling and the reported logprobs
  prefix_cache.py  finished sequences' KV, reused by requests that extend them
  model_files.py   the model folder's tokenizer and eos ids
Other modules: client.py (the HTTP client for either engine), sglang.py (a real SGLang server's argv).

SGLang behaviours followed (checked against sglang/srt: schedule_batch.py Req.check_finished and the FINISH_*
classes, detokenizer_manager.py trim_matched_stop, tokenizer_manager.py meta_info, entrypoints/http_server.py,
sampling/sampling_params.py):
- finish_reason is a dict: {"type": "stop", "matched": <token id | stop string>}, {"type": "length", "length": n},
  {"type": "abort", "message": ..., "status_code": null, "err_type": null}. The length check comes first: a stop
  token sampled as the max_new_tokens-th token finishes with "length".
- A matched stop token IS included in output_ids and in output_token_logprobs (its logprob is reported);
  `text` leaves it out. A matched stop string stays in output_ids (the tokens that produced it) and `text` is cut
  before it. `no_stop_trim` keeps both in text.
- `ignore_eos` disables every stop-token check (eos and stop_token_ids alike); stop strings still apply.
- temperature 0 means greedy (SGLang rewrites it as temperature 1 with top_k 1); top_k -1 means the whole vocab.
- output_token_logprobs are [[logprob, token_id, null], ...] (the text slot is filled with return_text_in_logprobs).
- Logprobs are of the sampled token under the model's distribution at temperature 1: log_softmax(logits), before
  temperature, top-k and top-p. SGLang by default returns log_softmax(logits / temperature) instead (still not
  renormalised for top-k/top-p) and returns the temperature-1 values when started with
  SGLANG_RETURN_ORIGINAL_LOGPROB=1 (`sglang.py` sets it). At temperature 1 both agree.
  `--temp-scaled-logprobs` makes the embedded engine return SGLang's default instead.
- /flush_cache always succeeds here (running requests never share cached KV); SGLang refuses it while busy.
- weight_version is a string in every response's meta_info (SGLang's ServerArgs.weight_version is a str).
- Errors: 400 {"error": {"message": ...}} for a bad request, like SGLang's _create_error_response.
  Where SGLang has no defined behaviour this engine answers 503 {"error": ...}: /generate while memory is released.
- release_memory_occupation needs an idle engine (SGLang asserts it): /pause_generation {"mode": "abort"} first
  (returns every request now with finish_reason abort; waiting requests may stay queued while paused), then
  /continue_generation after resuming. update_weights_from_disk waits for running requests to finish (SGLang's
  writer lock), or aborts them with abort_all_requests.
"""
