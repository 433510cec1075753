//! The profiler's calls to an engine and their timing: `/v1/models`, the Prometheus metrics'
//! `vllm:cache_config_info`, `GET /health`, and `/v1/completions`, streamed or whole, each
//! chunk timed as it arrives. Built on the HTTP client the replays use (hyper-util's pooled
//! client over `kvc_engine_sim::http::connector`, the SSE scanner of `kvc_core::sse`).

use super::ProfileError;
use super::fit::DecodeCounters;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvc_core::openai::{cached_tokens_of, completion_tokens_of};
use kvc_core::sse::{SseEvent, SseScanner};
use serde_json::Value;
use std::time::{Duration, Instant};

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

/// Bytes of an unexpected answer's body quoted in an error.
const QUOTED_BYTES: usize = 300;

/// The first bytes of `body`, as text.
fn quote(body: &[u8]) -> String {
    let cut = &body[..body.len().min(QUOTED_BYTES)];
    let mut s = String::from_utf8_lossy(cut).trim().to_owned();
    if body.len() > QUOTED_BYTES {
        s.push('…');
    }
    s
}

/// The model an engine serves, from its `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ServedModel {
    /// Its `id`: the name requests give.
    pub(super) id: String,
    /// Its `max_model_len`, when the entry has one (vLLM's does).
    pub(super) max_model_len: Option<u64>,
}

/// The models of an OpenAI model list (`{"object": "list", "data": [{"id": …}, …]}`), in
/// order; the error says what is wrong with the list.
pub(super) fn models_of(list: &Value) -> Result<Vec<ServedModel>, String> {
    let data = list
        .get("data")
        .and_then(Value::as_array)
        .ok_or("the answer is not an OpenAI model list (no `data` array)")?;
    let models: Vec<ServedModel> = data
        .iter()
        .filter_map(|m| {
            let id = m
                .get("id")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())?;
            Some(ServedModel {
                id: id.to_owned(),
                max_model_len: m.get("max_model_len").and_then(Value::as_u64),
            })
        })
        .collect();
    if models.is_empty() {
        return Err("the model list is empty: the engine serves no model".into());
    }
    Ok(models)
}

/// vLLM's cache configuration, from `vllm:cache_config_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CacheConfig {
    /// Tokens per KV block.
    pub(super) block_size: u64,
    /// Blocks in the KV pool.
    pub(super) num_gpu_blocks: u64,
}

/// The `block_size` and `num_gpu_blocks` labels of the first `vllm:cache_config_info` sample
/// of a Prometheus text exposition.
pub(super) fn cache_config(text: &str) -> Option<CacheConfig> {
    let line = text
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let labels = line.split_once('{')?.1.split_once('}')?.0;
    let label = |name: &str| {
        labels.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == name)
                .then(|| v.trim().trim_matches('"').parse::<u64>().ok())
                .flatten()
        })
    };
    Some(CacheConfig {
        block_size: label("block_size").filter(|b| *b > 0)?,
        num_gpu_blocks: label("num_gpu_blocks").filter(|b| *b > 0)?,
    })
}

/// The sum of every sample of the metric `name` in a Prometheus text exposition (`None`
/// when it has none, or a sample's value is not a number).
fn metric_total(text: &str, name: &str) -> Option<f64> {
    let mut total = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = if let Some(labels) = rest.strip_prefix('{') {
            labels.rsplit_once('}')?.1
        } else if rest.starts_with(' ') {
            rest
        } else {
            continue; // another metric whose name starts with this one's
        };
        let value: f64 = value.split_whitespace().next()?.parse().ok()?;
        total = Some(total.unwrap_or(0.0) + value);
    }
    total
}

/// vLLM's decode counters ([`DecodeCounters`]) from its `/metrics` text; `None` when the
/// engine does not report all three (the simulated workers).
pub(super) fn decode_counters(text: &str) -> Option<DecodeCounters> {
    Some(DecodeCounters {
        decode_seconds: metric_total(text, "vllm:request_decode_time_seconds_sum")?,
        finished: metric_total(text, "vllm:request_decode_time_seconds_count")?,
        generated: metric_total(text, "vllm:generation_tokens_total")?,
    })
}

/// One `/v1/completions` call as the client saw it.
#[derive(Debug, Clone)]
pub(super) struct Completion {
    /// When the request was handed to the connection.
    pub(super) sent: Instant,
    /// Streams: the arrival of every chunk that carried a choice (one per token on vLLM).
    /// Whole answers: the answer's arrival.
    pub(super) chunks: Vec<Instant>,
    /// Tokens generated, as the usage says.
    pub(super) completion_tokens: Option<u64>,
    /// Prompt tokens the engine found cached, as the usage says (`None`: not reported).
    pub(super) cached_tokens: Option<u64>,
    /// A whole answer's JSON (`Value::Null` for a stream).
    pub(super) body: Value,
}

impl Completion {
    /// Seconds from sending to the first token (to the answer, for a whole one).
    pub(super) fn first_token_s(&self) -> Option<f64> {
        self.chunks
            .first()
            .map(|t| t.saturating_duration_since(self.sent).as_secs_f64())
    }
}

/// The client the sweeps share.
#[derive(Clone)]
pub(super) struct Engines {
    client: Client,
    timeout: Duration,
}

impl Engines {
    /// A client whose calls each fail after `timeout`.
    pub(super) fn new(timeout: Duration) -> Self {
        // Idle connections are dropped before uvicorn's 5 s keep-alive closes them under a call.
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(4))
                .build(kvc_engine_sim::http::connector());
        Engines { client, timeout }
    }

    /// `GET url`: the body of a 2xx answer; `expected` says what should have come.
    async fn get(&self, url: &str, expected: &str) -> Result<Bytes, ProfileError> {
        let build = || {
            hyper::Request::get(url)
                .body(Full::new(Bytes::new()))
                .map_err(|e| ProfileError::Invalid(format!("bad URL {url}: {e}")))
        };
        let call = async {
            let resp = self.send(url, build).await?.1;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| transport(url, &e))?
                .to_bytes();
            if !status.is_success() {
                return Err(ProfileError::Status {
                    url: url.to_owned(),
                    status: status.as_u16(),
                    expected: expected.to_owned(),
                    body: quote(&body),
                });
            }
            Ok(body)
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| self.late(url))?
    }

    /// Sends the request `build` makes and returns when it was sent and the response head. A
    /// call whose connection failed once it had one (a kept-alive connection the server
    /// closed as the call went out) is sent once more, on another connection; a failure to
    /// connect is not.
    async fn send(
        &self,
        url: &str,
        build: impl Fn() -> Result<hyper::Request<Full<Bytes>>, ProfileError>,
    ) -> Result<(Instant, hyper::Response<hyper::body::Incoming>), ProfileError> {
        let sent = Instant::now();
        match self.client.request(build()?).await {
            Ok(resp) => Ok((sent, resp)),
            Err(e) if !e.is_connect() => {
                let sent = Instant::now();
                let resp = self
                    .client
                    .request(build()?)
                    .await
                    .map_err(|e| transport(url, &e))?;
                Ok((sent, resp))
            }
            Err(e) => Err(transport(url, &e)),
        }
    }

    fn late(&self, url: &str) -> ProfileError {
        ProfileError::Transport {
            url: url.to_owned(),
            message: format!(
                "no complete answer within {:.0} s (--request-timeout-s)",
                self.timeout.as_secs_f64()
            ),
        }
    }

    /// The models `base` serves (`GET /v1/models`), first first.
    pub(super) async fn models(&self, base: &str) -> Result<Vec<ServedModel>, ProfileError> {
        let url = format!("{base}/v1/models");
        let expected = "an OpenAI model list";
        let body = self.get(&url, expected).await?;
        let v: Value = serde_json::from_slice(&body).map_err(|_| ProfileError::Unexpected {
            url: url.clone(),
            message: format!("expected {expected} (JSON), got: {}", quote(&body)),
        })?;
        models_of(&v).map_err(|m| ProfileError::Unexpected { url, message: m })
    }

    /// The KV cache's block size and blocks from the Prometheus metrics at `url`.
    pub(super) async fn cache_config(&self, url: &str) -> Result<CacheConfig, ProfileError> {
        let expected = "Prometheus metrics with vllm:cache_config_info (not a vLLM engine?)";
        let body = self.get(url, expected).await?;
        cache_config(&String::from_utf8_lossy(&body)).ok_or_else(|| ProfileError::Unexpected {
            url: url.to_owned(),
            message: "no vllm:cache_config_info sample with block_size and num_gpu_blocks \
                      labels: not a vLLM engine? (--metrics-url names the metrics when they are \
                      not at URL/metrics)"
                .into(),
        })
    }

    /// The engine's decode counters from the Prometheus metrics at `url` (`None`: it does
    /// not report them).
    pub(super) async fn decode_counters(
        &self,
        url: &str,
    ) -> Result<Option<DecodeCounters>, ProfileError> {
        let body = self.get(url, "Prometheus metrics").await?;
        Ok(decode_counters(&String::from_utf8_lossy(&body)))
    }

    /// Median milliseconds of a few `GET /health` round trips at `base`.
    pub(super) async fn health_rtt_ms(&self, base: &str) -> Result<f64, ProfileError> {
        let url = format!("{base}/health");
        let mut ms = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            self.get(&url, "a 2xx health answer").await?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(super::fit::median(&ms))
    }

    /// `POST base/v1/completions` with `body` (and `X-Request-Id` when given), timed: every
    /// token-carrying chunk of a stream as it arrives, or the whole answer.
    pub(super) async fn complete(
        &self,
        base: &str,
        body: &Value,
        request_id: Option<&str>,
    ) -> Result<Completion, ProfileError> {
        self.complete_at(base, "/v1/completions", body, request_id)
            .await
    }

    /// [`Engines::complete`] at another path of the same API (`/v1/chat/completions`).
    pub(super) async fn complete_at(
        &self,
        base: &str,
        path: &str,
        body: &Value,
        request_id: Option<&str>,
    ) -> Result<Completion, ProfileError> {
        let url = format!("{base}{path}");
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let payload = Bytes::from(body.to_string());
        let build = || {
            let mut req =
                hyper::Request::post(url.as_str()).header("content-type", "application/json");
            if let Some(id) = request_id {
                req = req.header("x-request-id", id);
            }
            req.body(Full::new(payload.clone()))
                .map_err(|e| ProfileError::Invalid(format!("bad URL {url}: {e}")))
        };
        let call = async {
            let (sent, resp) = self.send(&url, build).await?;
            let status = resp.status();
            let mut body = resp.into_body();
            let mut out = Completion {
                sent,
                chunks: Vec::new(),
                completion_tokens: None,
                cached_tokens: None,
                body: Value::Null,
            };
            let mut whole = Vec::new();
            let mut scanner = SseScanner::new();
            let mut done = false;
            let ok = status.is_success();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| transport(&url, &e))?;
                let Some(data) = frame.data_ref() else {
                    continue;
                };
                if !(ok && stream) {
                    whole.extend_from_slice(data);
                    continue;
                }
                let at = Instant::now();
                for event in scanner.feed(data) {
                    done |= take_event(&url, event, at, &mut out)?;
                }
            }
            if !ok {
                return Err(ProfileError::Status {
                    url: url.clone(),
                    status: status.as_u16(),
                    expected: "a completion".into(),
                    body: quote(&whole),
                });
            }
            if stream {
                if let Some(event) = scanner.finish() {
                    done |= take_event(&url, event, Instant::now(), &mut out)?;
                }
                if !done || out.chunks.is_empty() {
                    return Err(ProfileError::Unexpected {
                        url: url.clone(),
                        message: "the stream ended without a token or without data: [DONE]".into(),
                    });
                }
            } else {
                out.chunks.push(Instant::now());
                let v: Value =
                    serde_json::from_slice(&whole).map_err(|_| ProfileError::Unexpected {
                        url: url.clone(),
                        message: format!("expected a JSON completion, got: {}", quote(&whole)),
                    })?;
                out.completion_tokens = completion_tokens_of(&v);
                out.cached_tokens = cached_tokens_of(&v);
                out.body = v;
            }
            Ok(out)
        };
        tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| self.late(&url))?
    }
}

/// Takes one streamed event into `out` (arrived at `at`); whether it was `[DONE]`. An error
/// event fails the call.
fn take_event(
    url: &str,
    event: SseEvent,
    at: Instant,
    out: &mut Completion,
) -> Result<bool, ProfileError> {
    let data = match event {
        SseEvent::Done => return Ok(true),
        SseEvent::Data(d) => d,
    };
    let Ok(v) = serde_json::from_slice::<Value>(&data) else {
        return Ok(false);
    };
    if let Some(e) = v.get("error") {
        return Err(ProfileError::Unexpected {
            url: url.to_owned(),
            message: format!("the stream ended with an error event: {e}"),
        });
    }
    if v.get("choices")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty())
    {
        out.chunks.push(at);
    }
    if v.get("usage").is_some_and(|u| !u.is_null()) {
        out.completion_tokens = completion_tokens_of(&v).or(out.completion_tokens);
        out.cached_tokens = cached_tokens_of(&v).or(out.cached_tokens);
    }
    Ok(false)
}

fn transport(url: &str, e: &dyn std::fmt::Display) -> ProfileError {
    ProfileError::Transport {
        url: url.to_owned(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_models_and_their_lengths_are_read() {
        let v = json!({"object": "list", "data": [
            {"id": "kvc-tiny", "object": "model", "max_model_len": 4096},
            {"id": "other"}]});
        let models = models_of(&v).unwrap();
        assert_eq!(
            models[0],
            ServedModel {
                id: "kvc-tiny".into(),
                max_model_len: Some(4096)
            }
        );
        assert_eq!(
            (models[1].id.as_str(), models[1].max_model_len),
            ("other", None)
        );
        let empty = models_of(&json!({"object": "list", "data": []})).unwrap_err();
        assert!(empty.contains("empty"), "{empty}");
        let other = models_of(&json!({"detail": "Not Found"})).unwrap_err();
        assert!(other.contains("not an OpenAI model list"), "{other}");
    }

    #[tokio::test]
    async fn a_call_whose_connection_closes_unanswered_is_sent_once_more() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/metrics", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            // The first connection reads the request and closes without a byte of answer.
            let (mut first, _) = listener.accept().await.unwrap();
            let _ = first.read(&mut buf).await.unwrap();
            drop(first);
            let (mut second, _) = listener.accept().await.unwrap();
            let _ = second.read(&mut buf).await.unwrap();
            second
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await
                .unwrap();
            // A third connection would mean a second retry.
            tokio::time::timeout(Duration::from_millis(300), listener.accept())
                .await
                .is_ok()
        });
        let engines = Engines::new(Duration::from_secs(5));
        let body = engines.get(&url, "metrics").await.unwrap();
        assert_eq!(&body[..], b"ok");
        assert!(!server.await.unwrap(), "one retry, no more");
        // Nothing listening: a connect error, not retried into success.
        let closed = "http://127.0.0.1:9/metrics";
        assert!(matches!(
            engines.get(closed, "metrics").await,
            Err(ProfileError::Transport { .. })
        ));
    }

    #[test]
    fn the_decode_counters_are_summed_over_their_samples() {
        let text = "# TYPE vllm:request_decode_time_seconds histogram\n\
                    vllm:request_decode_time_seconds_bucket{engine=\"0\",le=\"0.3\",model_name=\"m\"} 4.0\n\
                    vllm:request_decode_time_seconds_sum{engine=\"0\",model_name=\"m\"} 1.5\n\
                    vllm:request_decode_time_seconds_sum{engine=\"1\",model_name=\"m\"} 0.25\n\
                    vllm:request_decode_time_seconds_count{engine=\"0\",model_name=\"m\"} 6.0\n\
                    vllm:request_decode_time_seconds_count{engine=\"1\",model_name=\"m\"} 1.0\n\
                    vllm:generation_tokens_total{engine=\"0\",model_name=\"m {odd}\"} 190.0\n\
                    vllm:generation_tokens_created{engine=\"0\",model_name=\"m\"} 1.7e9\n\
                    vllm:generation_tokens_total_other 5\n";
        assert_eq!(
            decode_counters(text),
            Some(DecodeCounters {
                decode_seconds: 1.75,
                finished: 7.0,
                generated: 190.0,
            })
        );
        // An engine without them (the simulated workers) has none; a garbled value is none.
        assert_eq!(decode_counters("vllm:num_requests_running 2\n"), None);
        let garbled = text.replace("190.0", "many");
        assert_eq!(decode_counters(&garbled), None);
        assert_eq!(
            metric_total(
                "vllm:generation_tokens_total 3\n",
                "vllm:generation_tokens_total"
            ),
            Some(3.0)
        );
    }

    #[test]
    fn the_cache_config_is_read_from_vllm_metrics() {
        let text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
                    # TYPE vllm:cache_config_info gauge\n\
                    vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\",engine=\"0\",\
                    num_gpu_blocks=\"65536\",prefix_caching_hash_algo=\"sha256\"} 1.0\n";
        assert_eq!(
            cache_config(text),
            Some(CacheConfig {
                block_size: 32,
                num_gpu_blocks: 65_536
            })
        );
        assert_eq!(cache_config("sglang:token_usage 0.1\n"), None);
        assert_eq!(
            cache_config("vllm:cache_config_info{block_size=\"16\"} 1.0\n"),
            None
        );
    }

    #[test]
    fn stream_chunks_and_usage_are_taken() {
        let mut out = Completion {
            sent: Instant::now(),
            chunks: Vec::new(),
            completion_tokens: None,
            cached_tokens: None,
            body: Value::Null,
        };
        let at = Instant::now();
        let chunk = br#"{"choices": [{"index": 0, "text": "", "finish_reason": null}]}"#;
        assert!(!take_event("u", SseEvent::Data(chunk.to_vec()), at, &mut out).unwrap());
        let usage = br#"{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 8}}}"#;
        take_event("u", SseEvent::Data(usage.to_vec()), at, &mut out).unwrap();
        assert!(take_event("u", SseEvent::Done, at, &mut out).unwrap());
        assert_eq!(
            out.chunks.len(),
            1,
            "an empty-text chunk is a token; usage is not"
        );
        assert_eq!(
            (out.completion_tokens, out.cached_tokens),
            (Some(4), Some(8))
        );
        let err = take_event(
            "http://e/v1/completions",
            SseEvent::Data(br#"{"error": {"message": "boom"}}"#.to_vec()),
            at,
            &mut out,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("boom") && err.contains("http://e"), "{err}");
        assert_eq!(quote(&[b'x'; 400]).chars().count(), QUOTED_BYTES + 1);
    }
}
