//! The HTTP data plane: a front for SGLang- or vLLM-style prefill/decode workers.
//!
//! This module doc is the front's specification. [`http_app`] builds an `axum` router that
//! takes the client's request, asks the [`RouterService`] where it goes (the same decision
//! path as the gRPC `Route`, without gRPC), forwards it the way the workers' disaggregation
//! expects (SGLang's bootstrap rooms, or vLLM's NixlConnector `kv_transfer_params`: see
//! *The vLLM dialect*), returns the decode worker's answer and feeds the outcome back
//! (`ReportOutcome`).
//! The front sits on top of the routing service: nothing below it imports this module.
//!
//! | Route | Body |
//! |---|---|
//! | `POST /generate` | SGLang: `text` or `input_ids`, `sampling_params.max_new_tokens`, optional `session_params.id`, optional `stream`; 400 when any worker is `engine = "vllm"` |
//! | `POST /v1/completions` | OpenAI: `prompt` (text or token ids), `max_tokens`, optional `stream` |
//! | `POST /v1/chat/completions` | OpenAI: `messages` (`[{role, content}]`), `max_completion_tokens` or `max_tokens`, optional `stream` |
//! | `POST /v1/messages` | Anthropic Messages (Claude Code): `system`, `messages` (text, `tool_use`, `tool_result`, `thinking` blocks), `max_tokens` (required), optional `stream`; vLLM workers only |
//! | `POST /v1/messages/count_tokens` | Anthropic: passed as it is to one routable worker, taken in turn (nothing to route) |
//! | `POST /v1/responses` | OpenAI Responses (Codex CLI): `instructions`, `input` (a string, or message, `function_call`, `function_call_output`, `reasoning` items), `max_output_tokens`, optional `stream`; the whole conversation in each request (`previous_response_id` is refused: that conversation is held by the one engine that stored it); vLLM workers only |
//! | `DELETE /v1/sessions/{key}` | the client ends session `key`: its residency released at once (see *The end of a session*) |
//! | `GET /v1/sessions/{key}` | where the router holds session `key`: `decode_worker` (id) and `decode_worker_name`, `residency` (`resident`, `not-resident`, `evicted`), `resident_tokens`, `blocks` of its last request and `held_blocks` of them placed on that worker, `moves`; 404 when it holds none |
//! | `GET /health`, `GET /readyz` | readiness: 200 while a new request can be routed, else 503 saying why |
//! | `GET /livez` | liveness: 200 whenever the process answers |
//! | `GET /v1/models` | the workers' models (the first worker's own `/v1/models` to answer), OpenAI list shape |
//!
//! Every error the front answers itself has a JSON body, `{"error": {"message": "...",
//! "type": "...", "code": <status>}}` — on the Messages paths Anthropic's shape instead,
//! `{"type": "error", "error": {"type": "invalid_request_error" | "not_found_error" |
//! "request_too_large" | "overloaded_error" | "timeout_error" | "api_error" | …, "message":
//! "..."}}`, and a stream cut by a failed worker ends with an `error` event in the API's
//! shape: a malformed body or an over-long session id 400, an
//! unknown path 404, a method a path does not take 405, a body not arriving in time 408, a
//! body over [`HttpOptions::max_body_bytes`] 413, a malformed request head 400, a too long URI
//! 414, a head over `http.max-header-bytes` 431 (these three are hyper's own answers, given a
//! JSON body by the listener), no route 503, a connection past the limit 503, a worker that
//! did not answer 502/504. A worker's own non-2xx answer is passed through as it is.
//!
//! **Readiness and liveness.** `/health` is readiness, the same as `/readyz`: a colocated
//! cluster needs one routable colocated worker, a prefill/decode cluster one routable prefill
//! and one routable decode worker (a first turn goes through P). A worker is routable when
//! its state is fresh and healthy, its circuit breaker is not open and it has an `http-url`.
//! For its first [`KV_EVENTS_CATCH_UP_MS`](crate::KV_EVENTS_CATCH_UP_MS) a router
//! whose workers publish KV-cache events is not ready until each subscriber has caught up
//! with its engine by replay, so that its first decision already knows what every engine
//! holds (`KV-cache events of d0 still catching up with the engine (replay)`).
//! The 200 body is `{"status": "ok", "healthy_workers", "workers", "routable": {"prefill",
//! "decode", "colocated"}}`; the 503 body adds the JSON error naming what is missing (e.g.
//! `no routable prefill worker (0 of 1): a first turn cannot be routed`). `/livez` answers
//! 200 `{"status": "ok"}` whatever the workers' state: restart the process only when it
//! fails. Readiness is advice to a load balancer, not a gate: a request that comes while no
//! worker of a role it needs has fresh state (its snapshots, scrapes or events older than
//! `stale-after-ms`) is routed on the stale workers' last known state rather than refused
//! (`kvc_router_stale_routed_total`): a late publisher or a slow `/metrics` on a busy machine
//! is not a dead worker, and one that is gone fails the request, its breaker opens and the
//! request is retried elsewhere. Workers that are down, drained or excluded are never
//! routed so.
//!
//! **Client connections.** [`serve_front`] serves the front (the router binary uses it; see
//! [`ListenerOptions`], from the `[http]` table): hyper's HTTP/1.1 connection with keep-alive
//! and `TCP_NODELAY`, and these bounds —
//!
//! | key | default | what happens past it |
//! |---|---|---|
//! | `header-read-timeout-ms` | 10,000 | a request head not complete this long after its first byte: the connection is closed |
//! | `idle-timeout-ms` | 60,000 | no byte of a new request this long after the accept or the previous answer's last write: closed |
//! | `body-read-timeout-ms` | 30,000 | a body not complete this long after its head: 408, then closed |
//! | `max-header-bytes` | 65,536 | 431 (JSON), then closed |
//! | `max-body-bytes` | 16 MiB | 413 |
//! | `max-connections` | 1,024 | further connections go to the overflow |
//! | `overflow-connections` | 32 | past both, a new connection is closed at once, unanswered |
//!
//! A connection in the overflow has its one request answered — `GET /health`, `/readyz` and
//! `/livez` as usual, anything else 503 `the router is serving its maximum of N connections
//! (http.max-connections)` — and is then closed: health checkers keep getting answers while
//! the front is full, and no client holds an overflow place longer than the head deadline.
//! An accept that fails (e.g. no file descriptor left) pauses accepting for 100 ms. A request
//! in progress has no deadline of its own here: the worker calls have theirs
//! ([`HttpOptions::request_timeout`]). Per connection the front holds a task, hyper's state
//! and its read buffer (8 KiB, growing up to `max-header-bytes` + 8 KiB): measured with
//! 2,000 connections to the router binary, about 10.5 KB each while idle and 23 KB each
//! with a head arriving, so 1,024 connections cost 11–24 MB. A request in progress also
//! holds its body
//! while it is routed, several times over (the bytes, the parsed JSON, the payload sent to
//! the workers): budget `max-connections` × 4 × `max-body-bytes` for the worst case (64 GiB
//! at the defaults, reached only by 1,024 concurrent 16 MiB bodies; lower `max-body-bytes`
//! to fit the machine). The process's file-descriptor limit must exceed `max-connections` +
//! `overflow-connections` plus the connections to the workers (up to
//! `pool-max-idle-per-worker` idle per worker, one per call in flight).
//!
//! **What the front does not take from a client.** Fields only the router sets are removed
//! from every client body before it is routed, on every path and API: SGLang's pairing fields
//! (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`, `bootstrap_pair_key`,
//! `disagg_prefill_dp_rank`) and vLLM's `kv_transfer_params` (a decode worker given a
//! client's bootstrap host would call it). No client header is forwarded but the W3C trace
//! context: a worker request carries only `Content-Type`, the client's `traceparent` (when it
//! is W3C's form, with its `tracestate` of at most 512 bytes; an engine that traces joins the
//! client's trace; with tracing on, [`crate::telemetry`], the router's worker-call span in the
//! client's trace instead), the session header the front sets and, to a vLLM worker, the router's own
//! `X-Request-Id`, so no `x-kvc-*` header of a client reaches a worker. A session id (the
//! session header or
//! `session_params.id`) longer than [`HttpOptions::max_session_id_bytes`]
//! (`http.max-session-id-bytes`, default 256) gets 400 naming the limit before anything is
//! stored, echoed or forwarded.
//!
//! **The bytes a worker gets.** A client body from which nothing was removed is forwarded as
//! the client's own bytes: as they came when the attempt adds nothing to it (e.g. a vLLM
//! direct-to-D turn whose client asked for the usage chunk), or with the fields the attempt
//! adds (SGLang's `session_params` and bootstrap fields, vLLM's `kv_transfer_params`, the
//! usage option) appended as members, none of them being in the client's body. A body whose
//! own fields the attempt changes (P's request in the vLLM dialect, a client's
//! `stream_options` without the usage), or from which a router-only field was removed, is
//! written anew. A long prompt is thus neither copied nor re-encoded on its way to D.
//!
//! **Tokens and block hashes.** From `input_ids` (or a token-id `prompt`) with
//! [`block_hashes`] over the policy's block size. Text goes through the [`Tokenizer`] of
//! [`HttpOptions::tokenizer`] first: a Hugging Face `tokenizer.json` (`http.tokenizer` in the
//! configuration, `--tokenizer` on the command line; loaded at startup, a bad file stops the
//! start with an error naming it), else [`fallback_tokens`] (one token per whitespace-separated
//! word). A chat request's messages go through the simple template of [`chat_prompt`] (used
//! for hashing only; the worker gets the messages and applies its own template) and the same
//! tokenizer *one message at a time*, then its closing generation prompt
//! ([`kvc_core::text::chat_tokens`]); the block hashes cover the messages' tokens, not the
//! generation prompt's. A conversation that grows by appended messages (a user message after
//! a user message, an assistant reply and a user message, a tool result) therefore has its
//! previous request's hashed tokens as its prefix, whatever the tokenizer merges across a
//! message boundary and wherever the generation prompt fell in a block. The input length is
//! the number of tokens, the generation prompt's included. A tokenizer file whose tokens never
//! cross a space between two words (byte-level BPEs, checked at load) is used piece by piece
//! (`http/pieces.rs`): text is cut before such a space every kilobyte or so and each piece's
//! tokens are cached (64 MiB at most), so a turn that repeats the previous turn's text
//! tokenizes only its new part, with the ids a whole encoding gives.
//!
//! **Session and turn.** The session key is the first header of [`HttpOptions::session_headers`]
//! the request has (`http.session-headers`), else a field of the body: for `/generate`
//! `session_params.id`; for the OpenAI APIs (completions, chat, Responses) `prompt_cache_key`
//! (Codex CLI sets it to its conversation's id); for Messages the `session_id` Claude Code
//! writes into `metadata.user_id` (a JSON object there; `user_…_session_<id>` in earlier
//! versions; any other user id names a user, not a conversation, and is not taken). It maps
//! to a session id with [`kvc_core::SessionId::from_key`]. The default list is what the
//! common coding agents and benchmark clients send, in this order (read from each client's
//! own code):
//!
//! | header | sent by |
//! |---|---|
//! | `x-session-id` | kvc's replay driver and benchmark clients; OpenCode (1.18: `X-Session-Id`, its session id, to providers other than its own) |
//! | `x-claude-code-session-id` | Claude Code (2.1: `X-Claude-Code-Session-Id`, the session of the run) |
//! | `thread-id`, `session-id` | Codex CLI (0.171: the conversation thread and its session; a spawned subagent's thread has its own id) |
//! | `session_id` | Codex CLI, earlier versions (the conversation id) |
//! | `x-session-affinity` | OpenCode (the same session id) |
//!
//! A header of [`HttpOptions::agent_headers`] (`http.session-agent-headers`, default
//! `x-claude-code-agent-id`: Claude Code's subagents share their parent's session id and name
//! themselves with it) beside a session header makes the session that agent's own,
//! `<session>/agent/<agent>`: a subagent's conversation is not its parent's. Each part is
//! bounded by `http.max-session-id-bytes`; a present header that is empty or not text gets 400
//! naming it. The key goes to the workers in `x-session-id` ([`HttpOptions::session_header`]).
//!
//! **Subagents.** A session spawned by another names its parent: by the parent's own key in a
//! header of [`HttpOptions::parent_headers`] (`http.session-parent-headers`, default
//! `x-codex-parent-thread-id`, Codex CLI 0.171's spawned threads, and `x-parent-session-id`,
//! OpenCode's child sessions), or, for an agent within a client session, by a header of
//! [`HttpOptions::parent_agent_headers`] (`http.session-parent-agent-headers`, default
//! `x-claude-code-parent-agent-id`: the agent that spawned it, `<session>/agent/<parent>`;
//! without one the session's main conversation did). A new client key whose prompt goes on
//! past a live session's latest prompt (a subagent started from its parent's context) has
//! that session as its inferred parent. The first turn's decision then knows the parent
//! (`kvc`'s `subagent-placement`: direct-to-D on the parent's decode worker when it has room),
//! counted in `kvc_router_http_subagent_sessions_total{parent="header"|"inferred"}`.
//! Where each key came from is counted in
//! `kvc_router_http_session_keys_total{source=<header>|"session_params"|"prompt_cache_key"|"metadata.user_id"}`. The turn is a
//! per-session counter kept here (bounded by the router's `sessions.ttl-ms` and
//! `sessions.max`).
//!
//! **The end of a session.** A client that knows its session is over says so: `DELETE
//! /v1/sessions/{key}` (the key as sent in the session header, or an inferred session's
//! `x-kvc-session`), or `x-session-final: true` on the session's last request (the turn is
//! routed and answered as usual; `false` or `0` say it is not the last, anything else gets
//! 400). The front forgets the session (a later request with its key starts at turn 1), and
//! the router's session table and policy state drop it — at once for `DELETE`, once the
//! marked turn's outcome is in for the header — so what the router counted resident for it on
//! its decode worker is free for the next session placed there. A vLLM engine needs nothing
//! more (the session's blocks stay in its prefix cache unreferenced, the first to be
//! evicted). `DELETE` answers 200 `{"session", "ended": true}`, or 404 for a session the router
//! does not know (never seen, already ended, or expired). Counted in
//! `kvc_router_sessions_forgotten_total{cause="ended"}`; the endpoint picker reads the header
//! the same way.
//!
//! **Session inference.** A request with neither is placed by its prefix. The front remembers,
//! for each session it knows (keyed or inferred; same bounds), the chained block hash at the
//! last *full* block of the session's latest prompt, and the hash and length of the tokens
//! after it (the partial last block). A request whose block hashes hold one of those hashes at
//! the same position, and whose next tokens hash to that tail, extends the whole of that
//! prompt, whatever the block alignment, so it continues that session: the deepest such match
//! wins, ties go to the most recently seen session. A chat is hashed message by message
//! without its closing generation prompt ([`kvc_core::text::chat_tokens`]), so a request that
//! appends messages of any kind (a user message after a user message, a retry after a cut-off
//! answer, tool results) extends the previous one. Matching the whole prompt keeps a shared
//! system prompt from gluing two conversations together, however long it is: their first
//! prompts differ after it. Some agents (Qwen Code, Aider) add a reminder to the newest user
//! message of each request (the date before its text, the edit format's rules after it) and
//! send the history without it; a keyless request that holds a session's latest prompt with
//! one span left out of that prompt's newest user message (its role and some of its text
//! kept), the messages after it unchanged, and the span again in the request's own last
//! message continues that session too (the reminder moved; `docs/agents.md`). A request with no
//! such match but at least
//! [`HttpOptions::infer_min_blocks`] full blocks (`http.infer-min-blocks`, default 1) starts a
//! new inferred session, keyed `kvc-inferred-<16 hex digits>` (a per-process keyed hash of its
//! first block hashes and its request id), which later requests can continue; a shorter one is
//! routed without a session. `infer-min-blocks = 0` turns inference off.
//!
//! **A session id that changes every request.** Some clients send a new id with every
//! request of one conversation. A request whose key the front has not seen, yet whose prompt
//! extends (as above, at least `infer-min-blocks` full blocks long, and going on past it: a second session
//! that merely starts with the same first prompt is not one) the latest prompt of a session
//! another key named for one turn only — or of a session already found rotating — is taken as that
//! session's next turn: the id is not trusted, the request continues the first id's session
//! (`x-kvc-session` names it) and is counted in `kvc_router_http_rotated_session_ids_total`.
//! A session that kept its id for two turns or more is not rotating: a new id extending its
//! prompt is a session of its own (a subagent's, say). Counted in
//! `kvc_router_http_inferred_sessions_total{result="continued"|"new"}`.
//!
//! **Forwarding.** Each worker is reached at the `http-url` of its `[[workers]]` entry
//! (`http://host:port[/prefix]`; a worker without one gets no forwarded requests), a prefill
//! worker's bootstrap server at its `bootstrap-port` ([`DEFAULT_BOOTSTRAP_PORT`] when absent).
//! For a decision through a prefill worker (`turn1-seed`, `fallback`, `reseed`) the same JSON
//! body, with `bootstrap_host` (P's host), `bootstrap_port` (P's
//! bootstrap port) and a random `bootstrap_room` injected, goes to P and D concurrently; D's
//! answer is returned. `direct-to-d` sends the body to D alone with the session's continuation
//! parameters: for `/generate` without `session_params`, `session_params: {"id": <session
//! key>}` is added (a client's own `session_params` are kept as sent). `colocated` and
//! `local-prefill` send the body to the worker. With a session, every worker request (P and
//! D, every path, every API) carries the session header (the configured name) with the session key. Each worker call has
//! the deadline [`HttpOptions::request_timeout`].
//!
//! **Connections to the workers.** Every worker call (P, D, health checks) goes through one
//! pooled HTTP/1.1 client (hyper-util's): connections are kept alive and reused, an idle one
//! is closed after `http.pool-idle-timeout-ms` (default 4 s, below uvicorn's 5 s keep-alive),
//! at most `http.pool-max-idle-per-worker` idle ones are kept per worker (default 64; 0 opens
//! a connection per call), opening one has the deadline `http.connect-timeout-ms` (default
//! 5 s, within the call's own deadline), and `TCP_NODELAY` is set (see [`PoolOptions`]). A
//! worker request that is dropped (P or D abandoned, the client gone mid-stream) closes its
//! connection, so the worker sees the request end.
//!
//! The outcome is `ok` when D answered 2xx in full (the resident tokens are the input plus the
//! answer's `meta_info.completion_tokens` or `usage.completion_tokens`; a vLLM direct-to-D
//! turn may be `direct-cache-miss` instead, see *The vLLM dialect*). An engine that refused
//! the request itself — a 4xx answer other than 408 and 429, from D or (vLLM) from P — is
//! `invalid-request`, or `input-too-long` when its message says the prompt is over the
//! model's context ("maximum context length", "longer than the maximum model length"): the
//! client gets the engine's answer as it is, no circuit breaker hears of it, and the session
//! stays where it was (the engine touched none of its KV). Anything else is `worker-failed`.
//! On the SGLang path:
//! A prefill worker's fate does not change that once D has answered: if P fails while (or
//! after) D answers, D's answer goes to the client and P's failure counts against P's circuit
//! breaker. If P fails *before* D has answered anything, D is not waited for (it would only
//! wait for KV that never comes): D's request is dropped (not counted against D), the decision
//! reported `worker-failed`, and the request is retried without P when P's failure is
//! retryable (see *Retries*); otherwise P's answer goes to the client. The exception is P
//! answering **504**: P is up and says it gave up waiting for its decode partner (the only
//! party a prefill worker waits for is the decode worker joining its bootstrap room), so the
//! failure is D's — D's circuit breaker counts it, the retry avoids D (and may go through the
//! same P), P's breaker is left as it was, and with no retry left the client gets a 504
//! naming D. A worker that answered
//! non-2xx has its status and body passed through; one that did not answer gives 502 (504 on
//! a timeout). Responses carry `x-kvc-mode`, `x-kvc-decode-worker`, on a P→D path
//! `x-kvc-prefill-worker`, for a fall-through `x-kvc-reason` (e.g. `session-cap-rejected`),
//! and with a session `x-kvc-session` (the key, inferred ones included).
//!
//! **The vLLM dialect.** A `[[workers]]` entry with `engine = "vllm"` is a stock vLLM server
//! with NixlConnector P/D; a decision whose decode worker is one is carried out in vLLM's
//! two plain calls (for `/v1/completions`, `/v1/chat/completions`, `/v1/messages` and
//! `/v1/responses`, streaming or not; any other entry keeps the bootstrap protocol above; the
//! agents' two APIs are served only when every worker is a vLLM engine, whose endpoints for
//! them take `kv_transfer_params` as its chat endpoint does):
//!
//! - *P→D* (`turn1-seed`, `fallback`, `reseed`): first P gets the client's body with
//!   `kv_transfer_params` = `{"do_remote_decode": true, "do_remote_prefill": false,
//!   "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
//!   "remote_port": null}`, `"stream": false`, `"max_tokens": 1` (and
//!   `"max_completion_tokens": 1` when the client set it; for Responses `"max_output_tokens":
//!   1` and `"store": false` instead), without `stream_options` and `min_tokens`; then D gets the client's body with the top-level `kv_transfer_params` of
//!   P's answer copied verbatim (opaque to the router). Both calls carry the same
//!   `X-Request-Id` (`kvc-<request>-<decision>`) besides the session header. P's answer goes
//!   nowhere else; D's is relayed. A 4xx answer of P other than 408 and 429 (the request's
//!   own fault, e.g. a prompt over the model's limit) goes to the client as it is, reported
//!   `invalid-request` or `input-too-long`, D not called. If P fails — no answer within the deadline, a 5xx, 408 or
//!   429 status, or a 2xx answer without a `kv_transfer_params` object — the client's body goes
//!   to D alone and D prefills it itself: P's circuit breaker hears of the failure, the
//!   answer carries `x-kvc-prefill-failed: <P's id>`, and the decision is reported like any
//!   other (`ok` when D answered in full, D then holding the session). The router does not
//!   retry P elsewhere first: D serving the turn alone is the cheaper way out.
//! - *Direct-to-D*: the client's body to D as it is (no continuation parameters: vLLM's
//!   automatic prefix cache finds the blocks the session left there). vLLM has no admission
//!   refusal, so admission is the router's own, from D's state before the decision leaves
//!   [`RouterService::route_prompt`]: the engine events' eviction check (a D whose events
//!   hold less than half of what the plan counts on, as the blocks they credit to the
//!   session or the prompt's leading blocks on D, is not planned direct) and the probe of
//!   D's state (room for
//!   the turn), as for every direct-to-D decision. On a D whose events come as several
//!   data-parallel ranks, the request carries `X-data-parallel-rank: <r>` with the rank
//!   whose events hold the most of the session (vLLM's OpenAI server serves the request on
//!   that rank); when no rank holds any, or D has one rank, no such header is sent and the
//!   engine picks the rank.
//! - *Honest cache accounting*: a direct-to-D answer is judged by the prompt tokens D says
//!   it served from its cache, `usage.prompt_tokens_details.cached_tokens` (a whole answer's,
//!   or a stream's final usage chunk). Fewer than half of the tokens the decision counted on
//!   D holding ([`RouterDecision::cached_tokens`](crate::RouterDecision::cached_tokens))
//!   means the session had been evicted and D recomputed it: the decision is reported
//!   `direct-cache-miss` (not a mechanism error; counted in `kvc_router_outcomes_total`) with
//!   no resident tokens, so the policy stops counting the session resident on D and its next
//!   turn goes through P. An answer without the count is not judged: vLLM sends it only when
//!   started with `--enable-prompt-tokens-details`, and the first answer of a vLLM worker
//!   that carries `usage` without it is warned about once (`kvc_router_worker_cache_accounting`
//!   0 for that worker, 1 for one whose answers carry it).
//! - *Streams*: on the OpenAI completions and chat APIs D's request gets
//!   `stream_options.include_usage: true` (other stream options kept) so that its last chunk
//!   reports the cached tokens; when the client did not ask for usage itself, that usage-only
//!   chunk (`"choices": []`) is removed from the client's stream (the other events are relayed
//!   re-framed as `data:` lines, unchanged). A Messages stream reports them anyway (its
//!   `message_delta`'s `usage.cache_read_input_tokens`), a Responses stream in its
//!   `response.completed` (`response.usage.input_tokens_details.cached_tokens`): both are
//!   relayed byte for byte, `event:` lines and all. A non-streaming D request gets nothing
//!   added.
//! - *Local prefill* (`local-prefill`: the chosen worker prefills the turn itself, decodes it
//!   and keeps the session): the client's body to that worker as it is, exactly as
//!   direct-to-D (the same code path: no `kv_transfer_params`, `X-Request-Id` and the
//!   session header, on a stream `stream_options.include_usage` with the usage chunk removed
//!   when the client did not ask for it); no prefill worker is called, and nothing is judged
//!   for `direct-cache-miss` (the worker was not counted on holding the session). Reported
//!   like any decision (`ok` with the input plus the answer's tokens resident on that
//!   worker) and counted in `kvc_router_decisions_total{mode="local-prefill"}`. Only a
//!   worker that serves a turn alone gets one: by default every `engine = "vllm"` worker,
//!   of either role (a prefill worker that does then also hosts sessions); `serve-alone =
//!   false` in its `[[workers]]` entry keeps it to its role. A worker with `engine = "sglang"`
//!   never gets one (a stock SGLang prefill or decode server cannot serve a request without
//!   its partner; `serve-alone = true` is refused there), nor does a worker that declares
//!   neither `engine` nor `serve-alone` (configurations from before capabilities route as
//!   they did).
//! - `/generate` is SGLang's API: with any vLLM worker configured it is answered 400.
//!
//! **Admission refusals by D (the contract for engines with decode-side admission).** A
//! decode worker that cannot take a request — no room for a direct-to-D turn, or the session
//! is not resident — answers **`503` with the header `x-kvc-admission: rejected`** (and a JSON
//! error body). This is not a worker failure: it counts as a success for D's circuit breaker
//! and does not exclude D. For a direct-to-D decision, the decision is reported `rejected`
//! (the policy's view of what D holds is left as it was), and the request is routed again with
//! `rejected_by = D`, exactly as a gRPC caller would: the policy answers with a P→D path
//! (`fallback` with `session-cap-rejected`, or `reseed` with `migrated` after repeated
//! refusals), which is forwarded. This re-route happens at most once per request and is not a
//! retry. A refusal on a P→D path (or a second refusal) is reported `rejected` and tried on
//! another decode worker like a retryable failure, if a retry is left; otherwise the client
//! gets D's 503. Counted in `kvc_router_http_admission_rejects_total`. A decode worker whose
//! engine cannot append-prefill at all is declared with `append-prefill = false` in its
//! `[[workers]]` entry instead: it never gets a direct-to-D turn (later turns go P→D, reason
//! `direct-unsupported`). That is the default for `engine = "sglang"` (a stock SGLang decode
//! server answers 400 to a request without a bootstrap room); `append-prefill = true`
//! declares a patched engine that honours this contract.
//!
//! **Streaming.** With `"stream": true` the body is forwarded the same way, but D's answer is
//! relayed to the client as it arrives (chunked, with D's `Content-Type`, normally
//! `text/event-stream`), never buffered whole; P's answer is read and dropped. The client's
//! answer starts with D's first piece of body: until then the request can still be retried
//! (or re-routed after a refusal). The deadline [`HttpOptions::request_timeout`] bounds the wait
//! for D's response head, for its first piece and for each further one. If D's connection
//! breaks, its body is malformed or it goes silent past the deadline mid-stream, the client's
//! stream ends with one SSE error event,
//! `data: {"error": {"message": "...", "type": "worker_error", "code": 502}}`, and the
//! request is reported `worker-failed`. The outcome is reported when the stream has ended:
//! `ok` (resident tokens: the input plus the last `completion_tokens` seen in a `data:` event)
//! when D's stream completed with a 2xx status, else `worker-failed` (also when the client
//! went away first: nothing is claimed resident). A D that cannot be reached gets the same
//! JSON 502/504 as without streaming.
//!
//! **Resilience.** Options in [`HttpOptions`] (read from the `[http]` table of the
//! configuration, [`crate::HttpConfig`], by [`HttpOptions::from_config`]):
//!
//! - *Retries.* A request that failed before any byte reached the client — its decode worker
//!   refused the connection, broke it, gave no answer (streaming: no head, or no first piece)
//!   within the deadline, or answered 502, 503 or 504; or its prefill worker failed that way
//!   before D answered — is reported `worker-failed`, then routed again with
//!   [`RouterService::route_excluding`] (the workers that failed it count as down for that
//!   decision) and forwarded again, at most [`HttpOptions::max_retries`] times, after a
//!   jittered backoff ([`HttpOptions::retry_backoff`], doubling). A prefill worker that had
//!   already failed alongside a failed D is excluded too. When no other worker can take it,
//!   or the retries are spent, the client gets the last failure. Nothing is retried once a
//!   stream has started.
//! - *Circuit breakers.* Per worker, [`BreakerOptions::failure_threshold`] consecutive
//!   failures (connect error, timeout, 5xx other than an admission refusal, a stream broken
//!   off, a failed health check) open it: the worker is taken out of rotation with
//!   [`RouterService::set_http_down`], so no policy picks it, for a cool-down that doubles with
//!   each re-opening up to [`BreakerOptions::max_cooldown`] (with jitter). Then it is
//!   half-open: back in rotation for one trial request (out again while the trial runs); the
//!   trial's success closes the breaker, its failure (or no result within
//!   [`HttpOptions::request_timeout`]) opens it again; a trial dropped for the other worker's
//!   failure leaves it half-open for a new trial. Any successful request closes it.
//! - *Health checks.* Every [`HttpOptions::health_check_interval`], each worker's `GET
//!   /health` is checked within [`HttpOptions::health_check_timeout`]: no answer or a 5xx
//!   counts against its breaker; any other answer closes a half-open breaker. The checks run
//!   on the Tokio runtime the app is built in (none outside a runtime) and stop when the app
//!   is dropped.
//!
//! Metrics: `kvc_router_http_breaker_state`, `kvc_router_http_breaker_transitions_total`,
//! `kvc_router_http_retries_total`, `kvc_router_http_health_checks_total`,
//! `kvc_router_http_admission_rejects_total`, `kvc_router_http_inferred_sessions_total` (see
//! [`crate::metrics`]).
//!
//! **Where it is.** `routes` (axum routes and handlers), `retry` (a request from its body to
//! its answer: the route-and-forward loop), `session` and `infer` (session keys, turns,
//! inferred sessions), `request` and `tokens` (request bodies; token ids and block hashes),
//! `trust` (fields removed from client bodies, the session-id limit), `decision` (the calls
//! into [`RouterService`]), `attempt` (one forwarding attempt and how answers are judged,
//! including whose fault a P→D failure is, and the cache judgement of a direct turn),
//! `pairing` (P→D bootstrap fields, P's request), `vllm` (the vLLM dialect: P's body, P's
//! parameters to D, the usage chunk),
//! `direct` (direct-to-D
//! continuation parameters), `whole` and `stream` (a whole answer; a relayed stream), `sse`
//! (token counts in a stream, its error event), `breaker` and `health` (circuit breakers,
//! health checks), `listener` (client connections: deadlines, limits, JSON on hyper's own
//! answers), `app`, `options`, `endpoints`, `responses`, `error` (shared state, settings,
//! worker endpoints, JSON errors and decision headers, setup errors). Calls to the workers go
//! through the router's one pooled client, `crate::worker_http`.
//!
//! ```
//! use kvc_core::WorkerId;
//! use kvc_router::http::{WorkerEndpoints, http_app};
//! use kvc_router::{RouterConfig, RouterService};
//! use std::sync::Arc;
//!
//! let service = Arc::new(RouterService::new(RouterConfig::default())?);
//! let mut workers = WorkerEndpoints::new();
//! workers.insert(WorkerId(0), "http://10.0.0.1:30000", Some(8998))?;
//! workers.insert(WorkerId(1), "http://10.0.0.2:30000", None)?;
//! assert_eq!(workers.len(), 2);
//! let app: axum::Router = http_app(service, workers);
//! // kvc_router::http::serve_front(tokio::net::TcpListener::bind("0.0.0.0:8000").await?, app,
//! //     kvc_router::http::ListenerOptions::default(), None /* TLS */, stop_token).await;
//! # drop(app);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod app;
mod attempt;
mod breaker;
mod decision;
mod direct;
mod endpoints;
mod error;
mod gate;
mod health;
mod infer;
mod listener;
mod options;
mod pairing;
mod pieces;
mod request;
mod responses;
mod retry;
mod routes;
mod session;
mod sse;
mod stream;
mod tokens;
mod trust;
mod vllm;
mod whole;

pub use crate::worker_http::{ADMISSION_HEADER, ForwardError, MAX_RESPONSE_BYTES, PoolOptions};
pub use breaker::{BreakerOptions, BreakerState};
pub use endpoints::{DEFAULT_BOOTSTRAP_PORT, HttpWorker, WorkerEndpoints};
pub use error::FrontError;
pub use listener::{ListenerOptions, serve_front};
pub use options::HttpOptions;
pub use request::{
    DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_TOKENS, chat_prompt,
};
pub use responses::SESSION_RESPONSE_HEADER;
pub use session::SESSION_FINAL_HEADER;
pub use tokens::{Tokenizer, TokenizerError, block_hashes, fallback_tokens};
pub use vllm::PREFILL_FAILED_HEADER;

// What the endpoint picker (`crate::epp`) reads requests and judges answers with: the same
// functions as this front's.
pub(crate) use app::App;
pub(crate) use attempt::{cached_tokens, completion_tokens, judge_cache, refusal_outcome};
pub(crate) use decision::{Decision, report as report_outcome, route as route_query};
pub(crate) use direct::add_continuation_params;
pub(crate) use request::Api;
pub(crate) use responses::{in_anthropic_shape, route_error_response};
pub(crate) use retry::{Prepared, prepare_request};
pub(crate) use routes::readiness_of;
pub(crate) use sse::{CompletionScan, UsageFilter};
pub(crate) use vllm::{ask_for_usage, client_wants_usage};

use crate::RouterService;
use crate::telemetry::Telemetry;
use std::sync::Arc;

/// The HTTP front with the default [`HttpOptions`].
pub fn http_app(service: Arc<RouterService>, workers: WorkerEndpoints) -> axum::Router {
    http_app_with(service, workers, HttpOptions::default())
}

/// The HTTP front with explicit options. Health checks (when on, and with workers) run on the
/// Tokio runtime this is called in (none outside one) while the router lives.
pub fn http_app_with(
    service: Arc<RouterService>,
    workers: WorkerEndpoints,
    options: HttpOptions,
) -> axum::Router {
    routes::router(front_state(service, workers, options, Telemetry::off()))
}

/// [`http_app_with`] with tracing: a span per request and per worker call, made by
/// `telemetry` ([`crate::telemetry`]).
pub fn http_app_traced(
    service: Arc<RouterService>,
    workers: WorkerEndpoints,
    options: HttpOptions,
    telemetry: Telemetry,
) -> axum::Router {
    routes::router(front_state(service, workers, options, telemetry))
}

/// The front's shared state, its health checks started when on.
fn front_state(
    service: Arc<RouterService>,
    workers: WorkerEndpoints,
    options: HttpOptions,
    telemetry: Telemetry,
) -> Arc<app::App> {
    let health_checks = options
        .health_check_interval
        .filter(|i| !i.is_zero() && !workers.is_empty());
    let app = Arc::new(app::App::new(service, workers, options, telemetry));
    if let Some(interval) = health_checks {
        health::spawn_health_checks(&app, interval);
    }
    app
}

/// The HTTP front as `service`'s configuration describes it: the `[http]` table's options
/// (its tokenizer file loaded) and the workers' `http-url`s.
pub fn http_app_from_config(service: Arc<RouterService>) -> Result<axum::Router, FrontError> {
    Ok(routes::router(front_state_from_config(
        service,
        Telemetry::off(),
    )?))
}

/// The front's shared state as `service`'s configuration describes it (options, worker
/// endpoints, breakers, session book), its health checks started when on. The router binary
/// builds it once and serves it both as this front and as the endpoint picker
/// ([`crate::epp`]), so the two share sessions, breakers and request ids; its requests are
/// traced by `telemetry`.
pub(crate) fn front_state_from_config(
    service: Arc<RouterService>,
    telemetry: Telemetry,
) -> Result<Arc<app::App>, FrontError> {
    let options = HttpOptions::from_config(&service.config().http)?;
    let workers = WorkerEndpoints::from_config(service.config())?;
    Ok(front_state(service, workers, options, telemetry))
}

/// The axum routes of the front over an existing shared state.
pub(crate) fn router_over(app: Arc<app::App>) -> axum::Router {
    routes::router(app)
}
