//! `POST /generate`: finds the trace request by its prompt, hands this worker's part of it to
//! the engine thread and answers, whole or streamed.

use super::bootstrap::resolve_prefill;
use super::engine_thread::{Progress, RequestPart};
use super::sglang::{
    GenerateBody, WorkerContext, error_response, event_stream, find_prompt, invalid, json_response,
    meta_info, output_text, shutting_down,
};
use super::stream::SseAnswer;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use kvc_core::WorkerRole;
use serde_json::json;
use std::sync::Arc;
use std::time::Instant;

fn engine_stopped() -> Response {
    error_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        "worker_error",
        "the engine stopped",
    )
}

pub(super) async fn generate(State(ctx): State<Arc<WorkerContext>>, body: Bytes) -> Response {
    let arrived = std::time::Instant::now();
    let req = match GenerateBody::parse(&body) {
        Ok(r) => r,
        Err(m) => return invalid(&m),
    };
    let shared = &ctx.shared;
    let index = match find_prompt(&ctx, &req.text, ctx.role != WorkerRole::Prefill, arrived) {
        Ok(i) => i,
        Err(refusal) => return refusal.into_response(),
    };
    let job = shared.job(index, req.max_new_tokens);
    let output = job.output;
    let prompt_tokens = job.input;
    let part = match (ctx.role, req.room) {
        (WorkerRole::Colocated, _) => RequestPart::Colocated(ctx.id),
        (WorkerRole::Prefill, Some(room)) => RequestPart::PrefillLeg {
            room,
            prefill: ctx.id,
        },
        (WorkerRole::Prefill, None) => {
            return invalid(&format!(
                "{} is a prefill worker: `bootstrap_room` is required",
                ctx.name
            ));
        }
        (WorkerRole::Decode, None) => RequestPart::Direct(ctx.id),
        (WorkerRole::Decode, Some(room)) => {
            let Some((host, port)) = &req.bootstrap else {
                return invalid("`bootstrap_room` needs `bootstrap_host` and `bootstrap_port`");
            };
            match resolve_prefill(&ctx.client, host, *port, room).await {
                Ok(prefill) => RequestPart::DecodeLeg {
                    room,
                    decode: ctx.id,
                    prefill,
                },
                Err(m) => return error_response(StatusCode::BAD_GATEWAY, "bootstrap_error", &m),
            }
        }
    };
    let Some(mut progress) = shared.start_on_engine(index, job, part) else {
        return shutting_down();
    };
    match progress.recv().await {
        Some(Progress::Accepted) => {}
        Some(Progress::Rejected(m)) => {
            shared.with_served(index, |s| s.admission_rejects += 1);
            let mut resp =
                error_response(StatusCode::SERVICE_UNAVAILABLE, "admission_rejected", &m);
            resp.headers_mut()
                .insert("x-kvc-admission", HeaderValue::from_static("rejected"));
            return resp;
        }
        Some(Progress::Failed(status, m)) => {
            return error_response(status, "worker_error", &m);
        }
        Some(_) | None => return engine_stopped(),
    }
    let prefill_leg = matches!(part, RequestPart::PrefillLeg { .. });
    if req.stream {
        let answer = SseAnswer {
            progress,
            shared: shared.clone(),
            index,
            prompt_tokens,
            output,
            prefill_leg,
            finished: false,
        };
        return event_stream(answer.spawn());
    }
    // Whole answer: at the first token for a prefill leg, at the end otherwise.
    loop {
        match progress.recv().await {
            Some(Progress::FirstToken) if prefill_leg => {
                return json_response(
                    StatusCode::OK,
                    &json!({ "text": "", "meta_info": meta_info(index, prompt_tokens, 0, 0, false) }),
                );
            }
            Some(Progress::FirstToken | Progress::Accepted) => {
                let now = Instant::now();
                shared.with_served(index, |s| s.first_sent = Some(now));
            }
            Some(Progress::Done { cached }) => {
                let now = Instant::now();
                shared.with_served(index, |s| s.done_sent = Some(now));
                return json_response(
                    StatusCode::OK,
                    &json!({
                        "text": output_text(output),
                        "meta_info": meta_info(index, prompt_tokens, output, cached, true),
                    }),
                );
            }
            Some(Progress::Failed(status, m)) => {
                return error_response(status, "worker_error", &m);
            }
            Some(Progress::Rejected(m)) => {
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "worker_error", &m);
            }
            None => return engine_stopped(),
        }
    }
}
