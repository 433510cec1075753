//! A streamed `/generate` answer: a request's progress as SSE events, one at the first token
//! and one at the end, then `data: [DONE]`.

use super::engine_thread::Progress;
use super::sglang::{Chunk, meta_info, output_text};
use super::state::SharedState;
use axum::body::Bytes;
use kvc_core::sse;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// Turns a request's progress into SSE events.
pub(super) struct SseAnswer {
    pub(super) progress: UnboundedReceiver<Progress>,
    pub(super) shared: Arc<SharedState>,
    /// Trace index of the request.
    pub(super) index: usize,
    pub(super) prompt_tokens: u64,
    /// Tokens to generate.
    pub(super) output: u64,
    /// This is the prefill leg of a P→D request: it ends once the KV reached D.
    pub(super) prefill_leg: bool,
    /// The last event was sent.
    pub(super) finished: bool,
}

fn event(v: &Value) -> Chunk {
    Ok(Bytes::from(sse::event(&v.to_string())))
}

fn done() -> Chunk {
    Ok(Bytes::from_static(sse::DONE_EVENT.as_bytes()))
}

impl SseAnswer {
    /// Relays the events on a task; the receiver yields body chunks.
    pub(super) fn spawn(mut self) -> UnboundedReceiver<Chunk> {
        let (tx, out) = unbounded_channel();
        tokio::spawn(async move {
            while !self.finished {
                let Some(p) = self.progress.recv().await else {
                    let _ = tx.send(Err(std::io::Error::other("the engine stopped")));
                    return;
                };
                for chunk in self.chunks(p) {
                    if tx.send(chunk).is_err() {
                        return;
                    }
                }
            }
        });
        out
    }

    fn chunks(&mut self, p: Progress) -> Vec<Chunk> {
        match p {
            Progress::Accepted => Vec::new(),
            Progress::FirstToken if self.prefill_leg => {
                self.finished = true;
                let m = meta_info(self.index, self.prompt_tokens, 0, 0, false);
                vec![event(&json!({ "text": "", "meta_info": m })), done()]
            }
            Progress::FirstToken => {
                let m = meta_info(self.index, self.prompt_tokens, 1, 0, false);
                let now = Instant::now();
                self.shared
                    .with_served(self.index, |s| s.first_sent = Some(now));
                vec![event(&json!({ "text": "tok", "meta_info": m }))]
            }
            Progress::Done { cached } => {
                self.finished = true;
                let m = meta_info(self.index, self.prompt_tokens, self.output, cached, true);
                let now = Instant::now();
                self.shared
                    .with_served(self.index, |s| s.done_sent = Some(now));
                vec![
                    event(&json!({ "text": output_text(self.output), "meta_info": m })),
                    done(),
                ]
            }
            Progress::Failed(_, m) | Progress::Rejected(m) => {
                self.finished = true;
                vec![event(
                    &json!({ "error": { "message": m, "type": "worker_error", "code": 500 } }),
                )]
            }
        }
    }
}
