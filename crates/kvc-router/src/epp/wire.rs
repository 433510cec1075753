//! Envoy's ext_proc messages as the picker reads and writes them: headers in and out, the
//! dynamic metadata namespace, streamed body chunks, immediate answers.

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value};

/// The request header (and `envoy.lb` metadata key) naming the picked endpoint, `ip:port`.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The metadata key under which Envoy reports the endpoint that served a request.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The dynamic metadata namespace of the pick (read by Envoy's load balancing).
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the subset hint Envoy may send.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: a list of `ip:port` the pick must come from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The request header naming the prefill endpoint of a P→D request (llm-d's convention: the
/// decode side's sidecar runs the two-step).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The header saying why a request was shed (a 429).
pub const DROPPED_REASON_HEADER: &str = "x-kvc-request-dropped-reason";
/// Largest body chunk sent back to Envoy (Envoy's own limit for one message is above it).
pub const MAX_CHUNK: usize = 62_000;

/// A header's value as Envoy sent it (`raw_value`, else `value`), as text.
pub(crate) fn header_text(h: &EnvoyHeader) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// Envoy's headers as an `http` header map (pseudo-headers and invalid ones left out) and
/// the `:path` and `:method` pseudo-headers.
pub(crate) fn read_headers(
    headers: Option<&EnvoyHeaders>,
) -> (axum::http::HeaderMap, String, String, Option<u16>) {
    let mut map = axum::http::HeaderMap::new();
    let (mut path, mut method, mut status) = (String::new(), String::new(), None);
    for h in headers.map(|h| h.headers.as_slice()).unwrap_or_default() {
        let v = header_text(h);
        match h.key.as_str() {
            ":path" => path = v,
            ":method" => method = v,
            ":status" => status = v.parse().ok(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(name), Ok(value)) = (
                    axum::http::HeaderName::from_bytes(k.as_bytes()),
                    axum::http::HeaderValue::from_str(&v),
                ) {
                    map.append(name, value);
                }
            }
        }
    }
    (map, path, method, status)
}

/// A header to set (overwriting any the request has): `append_action` overwrite-if-exists-or-add.
pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeader {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        // OVERWRITE_IF_EXISTS_OR_ADD
        append_action: 2,
        ..Default::default()
    }
}

/// A string value of a protobuf `Struct`.
fn string_value(s: &str) -> Value {
    Value {
        kind: Some(value::Kind::StringValue(s.to_owned())),
    }
}

/// `{namespace: {key: text}}` as dynamic metadata.
pub(crate) fn metadata(namespace: &str, key: &str, text: &str) -> Struct {
    let inner = Struct {
        fields: [(key.to_owned(), string_value(text))].into_iter().collect(),
    };
    Struct {
        fields: [(
            namespace.to_owned(),
            Value {
                kind: Some(value::Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// The strings under `namespace.key` of Envoy's metadata: a string value, or a list of them,
/// or a comma-separated string (each entry trimmed).
pub(crate) fn metadata_strings(meta: Option<&Metadata>, namespace: &str, key: &str) -> Vec<String> {
    let Some(v) = meta
        .and_then(|m| m.filter_metadata.get(namespace))
        .and_then(|s| s.fields.get(key))
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut push = |v: &Value| {
        if let Some(value::Kind::StringValue(s)) = &v.kind {
            out.extend(
                s.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned),
            );
        }
    };
    match &v.kind {
        Some(value::Kind::ListValue(l)) => l.values.iter().for_each(&mut push),
        _ => push(v),
    }
    out
}

/// The answer to the request headers: the header mutation, `clear_route_cache` (the route is
/// chosen again with the new headers), and the dynamic metadata.
pub(crate) fn request_headers_response(
    set: Vec<HeaderValueOption>,
    remove: Vec<String>,
    dynamic: Option<Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers: set,
                        remove_headers: remove,
                    }),
                    clear_route_cache: true,
                    ..Default::default()
                }),
            },
        )),
        dynamic_metadata: dynamic,
        ..Default::default()
    }
}

/// The answer to the response headers: `set` added, `remove` removed.
pub(crate) fn response_headers_response(
    set: Vec<HeaderValueOption>,
    remove: Vec<String>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers: set,
                        remove_headers: remove,
                    }),
                    ..Default::default()
                }),
            },
        )),
        ..Default::default()
    }
}

/// One streamed body chunk, for the request (`request`) or the response, as a picker in
/// `FULL_DUPLEX_STREAMED` body mode sends it back.
pub fn body_chunk(request: bool, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    };
    let body = BodyResponse {
        response: Some(common),
    };
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestBody(body)
        } else {
            processing_response::Response::ResponseBody(body)
        }),
        ..Default::default()
    }
}

/// `body` as streamed chunks of at most [`MAX_CHUNK`] bytes, the last one ending the stream
/// (one empty chunk for an empty body).
pub(crate) fn body_chunks(request: bool, body: &[u8]) -> Vec<ProcessingResponse> {
    if body.is_empty() {
        return vec![body_chunk(request, Vec::new(), true)];
    }
    let n = body.len().div_ceil(MAX_CHUNK);
    body.chunks(MAX_CHUNK)
        .enumerate()
        .map(|(i, c)| body_chunk(request, c.to_vec(), i + 1 == n))
        .collect()
}

/// The answer to trailers: unchanged.
pub(crate) fn trailers_response(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestTrailers(t)
        } else {
            processing_response::Response::ResponseTrailers(t)
        }),
        ..Default::default()
    }
}

/// An answer Envoy gives the client itself, without calling any endpoint: `status`, a JSON
/// `body`, and `extra` headers.
pub(crate) fn immediate(status: u16, body: Vec<u8>, extra: &[(&str, &str)]) -> ProcessingResponse {
    let mut set = vec![set_header("content-type", "application/json")];
    set.extend(extra.iter().map(|(k, v)| set_header(k, v)));
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers: set,
                    remove_headers: Vec::new(),
                }),
                body,
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk_of(r: &ProcessingResponse) -> (usize, bool) {
        let Some(processing_response::Response::RequestBody(b)) = &r.response else {
            panic!("not a request body answer: {r:?}");
        };
        let Some(body_mutation::Mutation::StreamedResponse(s)) = b
            .response
            .as_ref()
            .and_then(|c| c.body_mutation.as_ref())
            .and_then(|m| m.mutation.as_ref())
        else {
            panic!("not a streamed body: {r:?}");
        };
        (s.body.len(), s.end_of_stream)
    }

    #[test]
    fn bodies_go_back_in_chunks_of_at_most_62000_bytes() {
        let body = vec![b'x'; 2 * MAX_CHUNK + 5];
        let chunks: Vec<(usize, bool)> = body_chunks(true, &body).iter().map(chunk_of).collect();
        assert_eq!(chunks, [(MAX_CHUNK, false), (MAX_CHUNK, false), (5, true)]);
        let exact: Vec<(usize, bool)> = body_chunks(true, &body[..MAX_CHUNK])
            .iter()
            .map(chunk_of)
            .collect();
        assert_eq!(exact, [(MAX_CHUNK, true)]);
        let empty: Vec<(usize, bool)> = body_chunks(true, &[]).iter().map(chunk_of).collect();
        assert_eq!(empty, [(0, true)]);
    }

    #[test]
    fn metadata_strings_are_read_from_lists_and_comma_lists() {
        let mut meta = Metadata::default();
        let list = Value {
            kind: Some(value::Kind::ListValue(
                envoy_types::pb::google::protobuf::ListValue {
                    values: vec![string_value("10.0.0.1:80"), string_value("10.0.0.2:80")],
                },
            )),
        };
        meta.filter_metadata.insert(
            SUBSET_NAMESPACE.into(),
            Struct {
                fields: [(SUBSET_KEY.to_owned(), list)].into_iter().collect(),
            },
        );
        meta.filter_metadata.insert(
            LB_NAMESPACE.into(),
            metadata(LB_NAMESPACE, SERVED_KEY, "x")
                .fields
                .remove(LB_NAMESPACE)
                .and_then(|v| match v.kind {
                    Some(value::Kind::StructValue(s)) => Some(s),
                    _ => None,
                })
                .unwrap(),
        );
        assert_eq!(
            metadata_strings(Some(&meta), SUBSET_NAMESPACE, SUBSET_KEY),
            ["10.0.0.1:80", "10.0.0.2:80"]
        );
        assert_eq!(
            metadata_strings(Some(&meta), LB_NAMESPACE, SERVED_KEY),
            ["x"]
        );
        assert!(metadata_strings(None, LB_NAMESPACE, SERVED_KEY).is_empty());
        let mut comma = Metadata::default();
        comma.filter_metadata.insert(
            LB_NAMESPACE.into(),
            Struct {
                fields: [(SERVED_KEY.to_owned(), string_value("a:1, b:2"))]
                    .into_iter()
                    .collect(),
            },
        );
        assert_eq!(
            metadata_strings(Some(&comma), LB_NAMESPACE, SERVED_KEY),
            ["a:1", "b:2"]
        );
    }

    #[test]
    fn headers_are_read_from_raw_values_and_pseudo_headers_apart() {
        let h = |k: &str, v: &str| EnvoyHeader {
            key: k.into(),
            raw_value: v.as_bytes().to_vec(),
            ..Default::default()
        };
        let headers = EnvoyHeaders {
            headers: vec![
                h(":path", "/v1/completions?x=1"),
                h(":method", "POST"),
                h("x-session-id", "s1"),
                EnvoyHeader {
                    key: "content-type".into(),
                    value: "application/json".into(),
                    ..Default::default()
                },
            ],
        };
        let (map, path, method, status) = read_headers(Some(&headers));
        assert_eq!(
            (path.as_str(), method.as_str(), status),
            ("/v1/completions?x=1", "POST", None)
        );
        assert_eq!(map["x-session-id"], "s1");
        assert_eq!(map["content-type"], "application/json");
        assert_eq!(map.len(), 2);
    }
}
