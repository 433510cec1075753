//! One client request from its body to its answer: parsed, its session resolved, its tokens
//! hashed, then routed and forwarded — and, after a failure before the first byte reached the
//! client, routed again away from the failed workers (with backoff), or through P after a
//! decode worker's admission refusal.

use super::app::App;
use super::attempt::{AttemptResult, ForwardedRequest};
use super::decision::{self, RouteQuery};
use super::direct::add_continuation_params;
use super::infer::Turns;
use super::request::{self, Api, Prompt};
use super::responses::{error_response, route_error_response, with_decision_headers};
use super::session::{ClientKey, client_key, parent_key, session_final};
use super::stream::forward_stream;
use super::tokens::block_hashes;
use super::trust::{check_session_id, strip_router_fields};
use super::vllm::forward_vllm;
use super::whole::forward_whole;
use crate::telemetry::{HeaderExtractor, RequestSpan};
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use kvc_core::{ExecutionMode, SessionId, WorkerId};
use std::sync::Arc;
use std::time::Duration;

/// A client request ready to route: the routing query, what every attempt forwards (the body
/// among it, router-only fields removed) and whether the client asked for a stream.
pub(crate) struct Prepared {
    pub(crate) query: RouteQuery,
    pub(crate) request: ForwardedRequest,
    pub(crate) stream: bool,
    /// The client marked the request its session's last turn ([`super::SESSION_FINAL_HEADER`]).
    pub(crate) ends_session: bool,
}

/// The client's answer to `bytes`, a request to `api`.
pub(super) async fn serve_request(
    app: &Arc<App>,
    api: Api,
    headers: &HeaderMap,
    bytes: Bytes,
) -> Response {
    let span = app
        .telemetry
        .request_span("kvc.request", api.path(), &HeaderExtractor(headers));
    let response = match prepare_request(app, api, headers, bytes).await {
        Ok(mut p) => {
            span.record_session(p.request.session_key.as_ref(), p.query.session());
            p.request.trace = span.clone();
            route_and_forward(app, p.query, &p.request, p.stream, p.ends_session).await
        }
        Err(response) => response,
    };
    span.record_status(response.status().as_u16());
    response
}

/// Everything the front reads from a client request before routing it: the body parsed, the
/// session key (the session header, the body's session field, else inferred from the
/// prefix) bounded and resolved to a session and turn, router-only fields removed, the
/// prompt tokenized and hashed. A request that cannot be routed is the 400 answer to give.
/// Every front that routes client requests (this one, and the endpoint picker in
/// `crate::epp`) reads them here.
pub(crate) async fn prepare_request(
    app: &Arc<App>,
    api: Api,
    headers: &HeaderMap,
    bytes: Bytes,
) -> Result<Prepared, Response> {
    let bad_request =
        |message: &str| error_response(StatusCode::BAD_REQUEST, "invalid_request_error", message);
    if api == Api::Generate && app.workers.any_vllm() {
        return Err(bad_request(
            "/generate is SGLang's API and this cluster has vLLM workers (engine = \"vllm\"): \
             send /v1/completions or /v1/chat/completions",
        ));
    }
    if api.vllm_only() && !app.workers.all_vllm() {
        return Err(super::routes::not_vllm(api));
    }
    let mut req = request::parse(api, &bytes).map_err(|m| bad_request(&m))?;
    let ends_session = session_final(headers).map_err(|m| bad_request(&m))?;
    // Every session id the client sent (both are forwarded: the header as the session key,
    // the body as it is) is bounded before anything is kept or forwarded.
    let limit = app.options.max_session_id_bytes;
    let from_headers = client_key(
        headers,
        &app.options.session_headers,
        &app.options.agent_headers,
        limit,
    )
    .map_err(|m| bad_request(&m))?;
    let parent_key = parent_key(
        headers,
        from_headers.as_ref(),
        &app.options.parent_headers,
        &app.options.parent_agent_headers,
        limit,
    )
    .map_err(|m| bad_request(&m))?;
    if let Some((key, _)) = &req.session_key {
        check_session_id(key, limit).map_err(|m| bad_request(&m))?;
    }
    let client_bytes = if strip_router_fields(&mut req.body) > 0 {
        tracing::debug!("router-only fields removed from a client request");
        None
    } else {
        Some(bytes)
    };
    // Block hashes cover the prompt, but for a chat not its closing generation prompt (which
    // the conversation's next request replaces with a message).
    let (tokens, hashed, starts, newest_user) = match &req.prompt {
        Prompt::Tokens(t) => (t.clone(), t.len(), Vec::new(), None),
        Prompt::Text(text) => {
            let t = app.options.tokenizer.encode_off_thread(text).await;
            let n = t.len();
            (t, n, Vec::new(), None)
        }
        Prompt::Chat(messages) => {
            let c = app.options.tokenizer.encode_chat_off_thread(messages).await;
            let newest_user = messages.iter().rposition(|(role, _)| role == "user");
            (c.tokens, c.messages, c.starts, newest_user)
        }
    };
    let turns = (!starts.is_empty()).then_some(Turns {
        starts: &starts,
        newest_user,
    });
    if tokens.is_empty() {
        return Err(bad_request("the prompt is empty"));
    }
    let block = app.service.config().policy.block_size();
    let hash_ids = block_hashes(&tokens[..hashed], block);
    let request_id = app.next_request_id();
    let client_key = match from_headers {
        Some(ClientKey { key, source, .. }) => {
            app.count_session_key(source);
            Some(key)
        }
        None => req.session_key.clone().map(|(key, source)| {
            app.count_session_key(source);
            key
        }),
    };
    let resolved = app.sessions.resolve(
        &app.service,
        client_key.as_deref(),
        (&tokens[..hashed], block),
        turns,
        &hash_ids,
        request_id,
    );
    if ends_session && let Some(r) = &resolved {
        // The front forgets the session now; the router's state once the turn is answered.
        app.sessions.end(r.session);
    }
    let input_length = tokens.len() as u64;
    let mut query = RouteQuery::new(
        request_id,
        resolved.as_ref().map(|r| (r.session, r.turn)),
        input_length,
        req.output_hint,
        hash_ids,
    )
    .with_prompt(tokens);
    // A subagent's first turn names its parent: by a header, or inferred from the prompt.
    if let Some(r) = resolved.as_ref().filter(|r| r.turn == 1) {
        app.service.metrics().record_session_started();
        let named = parent_key
            .as_deref()
            .map(SessionId::from_key)
            .filter(|p| *p != r.session);
        let parent = named.or(r.forked_from);
        if parent.is_some() {
            app.service
                .metrics()
                .record_subagent_session(named.is_none());
        }
        query.set_parent(parent);
    }
    // With the worker calls' debug lines (`worker_http`), the timeline of each turn.
    tracing::debug!(
        request = request_id,
        session = resolved.as_ref().map_or("-", |r| &*r.key),
        turn = resolved.as_ref().map_or(0, |r| r.turn),
        input_tokens = input_length,
        "request received"
    );
    let request = ForwardedRequest {
        api,
        request_id,
        input_length,
        session_key: resolved.map(|r| r.key),
        body: req.body,
        client_bytes,
        trace_context: super::attempt::trace_context(headers),
        trace: RequestSpan::none(),
    };
    Ok(Prepared {
        query,
        request,
        stream: req.stream,
        ends_session,
    })
}

/// Routes and forwards until an attempt answers the client, the retries are spent or no
/// other worker can take the request.
async fn route_and_forward(
    app: &Arc<App>,
    mut query: RouteQuery,
    request: &ForwardedRequest,
    stream: bool,
    ends_session: bool,
) -> Response {
    let session_key = request.session_key.as_deref();
    let mut excluded: Vec<WorkerId> = Vec::new();
    let mut attempt = 0u32;
    let mut retrying = false;
    let mut admission_rerouted = false;
    // The previous attempt's failure, answered when no other worker can take the request.
    let mut previous: Option<Response> = None;
    loop {
        app.breakers.tick(&app.service, app.service.now_ms());
        let decision = match decision::route_traced(&app.service, &query, &excluded, &request.trace)
        {
            Ok(d) => d,
            Err(e) => return previous.unwrap_or_else(|| route_error_response(&e)),
        };
        tracing::debug!(
            request = request.request_id,
            attempt,
            mode = %decision.mode,
            reason = decision.reason.map_or_else(|| "-".to_owned(), |r| r.to_string()),
            prefill = ?decision.prefill.map(|w| w.0),
            decode = decision.decode.0,
            cached_tokens = decision.cached_tokens,
            "request routed"
        );
        if ends_session {
            // Every attempt's report ends the session, the answered one's last.
            app.service.end_session_after(decision.id);
        }
        // A `rejected_by` is answered by one decision; later retries are plain re-routes.
        query.set_rejected_by(None);
        if std::mem::take(&mut retrying) {
            app.service.metrics().record_http_retry();
        }
        let may_retry = attempt < app.options.max_retries;
        let mut body = request.body.clone();
        if decision.mode == ExecutionMode::DirectToD {
            add_continuation_params(request.api, &mut body, session_key);
        }
        // A decision without a prefill worker (direct-to-D, local prefill, colocated) is one
        // call to the chosen worker, on the same path in either dialect.
        let result = if request.api != Api::Generate && app.workers.is_vllm(decision.decode) {
            forward_vllm(app, request, body, &decision, stream, may_retry).await
        } else if stream {
            forward_stream(
                app,
                request,
                body,
                &decision,
                may_retry,
                &Default::default(),
            )
            .await
        } else {
            forward_whole(app, request, body, &decision, &Default::default()).await
        };
        let respond = |response| with_decision_headers(response, &decision, session_key);
        let (response, failed) = match result {
            AttemptResult::Answered(response) => return respond(response),
            AttemptResult::RetryElsewhere { response, failed } => (respond(response), failed),
            AttemptResult::RefusedByAdmission {
                response,
                decode,
                direct,
            } => {
                app.service.metrics().record_http_admission_reject();
                let response = respond(response);
                if direct && !admission_rerouted {
                    // Like a gRPC caller whose admission refused a direct-to-D decision: route
                    // again with `rejected_by`; the policy answers with a P→D path. Not a retry,
                    // and at most once per request.
                    admission_rerouted = true;
                    query.set_rejected_by(Some(decode));
                    previous = Some(response);
                    tracing::info!(
                        request = request.request_id,
                        decode = decode.0,
                        "direct-to-D turn refused by the decode worker; re-routing through P"
                    );
                    continue;
                }
                (response, vec![decode])
            }
        };
        if !may_retry {
            return response;
        }
        previous = Some(response);
        attempt += 1;
        retrying = true;
        for w in failed {
            if !excluded.contains(&w) {
                excluded.push(w);
            }
        }
        let wait = backoff(app, attempt);
        tracing::info!(
            request = request.request_id,
            attempt,
            excluded = ?excluded,
            wait_ms = wait.as_millis() as u64,
            "re-routing a failed request"
        );
        tokio::time::sleep(wait).await;
    }
}

/// The jittered wait before retry `attempt` (from 1): the backoff doubled per retry,
/// shortened by up to a half.
fn backoff(app: &App, attempt: u32) -> Duration {
    let base = app
        .options
        .retry_backoff
        .saturating_mul(1 << attempt.saturating_sub(1).min(16));
    base.mul_f64(1.0 - 0.5 * app.breakers.unit())
}
